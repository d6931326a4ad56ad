"""``benchmarks/compile_zoo.py``: a Hugging Face architecture compiled at pp 2 in one
process against the plain model, its row and its summary."""

from __future__ import annotations

import pytest

from benchmarks.compile_zoo import main


def test_vit_compiled_equals_one_process_and_counts_its_copies(
        one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--archs", "vit"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("vit ")]
    assert [r[1] for r in rows] == ["1F1B", "ZB-V"]
    for r in rows:
        assert r[2] == "ok", out
        assert int(r[4]) == 0 and int(r[5]) == 0  # nothing eager, no recompile
        assert int(r[6]) >= 1  # cls_token's gradient, handed in position_embeddings' memory
    assert "2 rows: 2 equal the one-process run" in out


def test_an_unknown_architecture_is_refused_with_the_known_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--archs", "vitt"])
    err = capsys.readouterr().err
    assert "unknown architectures ['vitt']" in err and "'vit'" in err


def test_checkpointed_layers_at_new_lengths_equal_one_process(
        one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--archs", "gpt2", "--checkpointed", "--lengths", "16,24,12"]) == 0
    out = capsys.readouterr().out
    assert "every layer checkpointed, sequence lengths [16, 24, 12]" in out
    rows = {line.split()[1]: line.split() for line in out.splitlines()
            if line.startswith("gpt2 ")}
    assert sorted(rows) == ["1F1B", "ZB-V"] and all(r[2] == "ok" for r in rows.values()), out
    assert int(rows["1F1B"][5]) >= 1  # 24 tokens after 16: the stages recompiled
    # under ZB-V a checkpointed layer in a chunk that receives gradients runs eagerly, said
    assert "ZB-V stage" in out and "checkpointed regions (rebuilt once" in out


def test_lengths_that_are_not_numbers_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--archs", "gpt2", "--lengths", "16,x"])
    assert "--lengths '16,x': give whole numbers" in capsys.readouterr().err
