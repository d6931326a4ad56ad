"""What ``tests.helpers.dist.run_ranks`` reports when ranks fail: the rank that failed first
in full (most often the cause), its peers' ends after it, and a rank that died without a
report ahead of the ranks that reported (its death is seen only once the queue is quiet)."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.dist import RankFailed, run_ranks


def _cause_then_peer() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("the cause")
    time.sleep(0.5)
    raise RuntimeError("the peer, seeing its connection closed")


def _one_dies() -> None:
    if int(os.environ["RANK"]) == 1:
        time.sleep(0.2)
        os._exit(3)
    raise RuntimeError("the peer, seeing its connection closed")


@pytest.mark.multiproc
def test_the_rank_that_failed_first_is_reported_in_full_before_its_peers() -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_cause_then_peer, 2, timeout=30)
    text = str(failed.value)
    assert "in this order: [1, 0]" in text and "rank 1, the first" in text, text
    assert text.index("the cause") < text.index("the peer"), text


@pytest.mark.multiproc
def test_a_rank_that_died_without_a_report_comes_first() -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_one_dies, 2, timeout=30)
    text = str(failed.value)
    assert "in this order: [1, 0]" in text, text
    assert "rank 1, the first:\nprocess exited with code 3" in text, text
