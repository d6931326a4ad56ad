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
