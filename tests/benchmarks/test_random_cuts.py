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
