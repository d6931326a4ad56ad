"""``benchmarks/random_cuts.py``: a case runs, is counted, and bad names are refused."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.mark.multiproc
def test_one_architecture_under_zbv_is_counted_ok(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import random_cuts

    assert random_cuts.main(["--archs", "gpt2", "--features", "zbv", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "zbv: 1 ok (0 of them falling back), 0 refused, 0 wrong" in out


def test_unknown_names_are_refused_before_anything_runs() -> None:
    from benchmarks import random_cuts

    with pytest.raises(SystemExit):
        random_cuts.main(["--features", "zbv,fsdp3"])


def test_a_verdict_names_the_cause_and_what_fell_back_on_any_rank() -> None:
    from benchmarks.random_cuts import _verdict

    lost = "WRONG: SMPPeerError: rank 1 exited"
    assert _verdict(["ok", lost, "WRONG: ValueError: shapes"]) == "WRONG: ValueError: shapes"
    assert _verdict(["ok", lost]) == lost
    assert _verdict(["ok", "refused: no sequence input"]) == "refused: no sequence input"
    assert _verdict(["ok, fell back: stage 0 eager (graph break)",
                     "ok, fell back: stage 1 eager (graph break); stage 0 eager (graph break)"]
                    ) == ("ok, fell back: stage 0 eager (graph break); stage 1 eager (graph "
                          "break)")
    assert _verdict(["ok", "ok"]) == "ok"
