"""The comparison behind ``SMP_FX_CHECK_ORDER``, on hand-written records: what passes, and the
first mismatch named (rank, group, position, both calls)."""

from __future__ import annotations

import pytest

from cost_model.errors import SMPOrderError
from smp_fx.world.order_check import COLLECTIVE, RECV, SEND, Call, GroupLog, first_mismatch

A, B = ((4, 8),), ((8,),)


def _coll(seq: int, shapes: tuple[tuple[int, ...], ...], op: str = "all_reduce",
          root: int | None = None) -> Call:
    return Call(seq, op, COLLECTIVE, shapes, ("float32",) * len(shapes), root=root)


def _log(*calls: Call, ranks: tuple[int, ...] = (0, 1)) -> GroupLog:
    return GroupLog(ranks, "the dp group", calls)


def test_equal_records_and_matched_messages_pass() -> None:
    send = Call(0, "send", SEND, A, ("float32",), peer=1)
    recv = Call(0, "recv", RECV, A, ("float32",), peer=0)
    logs = [{"3": _log(_coll(0, A), _coll(1, B)), "5": _log(send)},
            {"3": _log(_coll(0, A), _coll(1, B)), "5": _log(recv)}]
    assert first_mismatch(logs) is None


def test_swapped_collectives_name_rank_group_position_and_both_calls() -> None:
    logs = [{"3": _log(_coll(0, B), _coll(1, A), _coll(2, B))},
            {"3": _log(_coll(0, B), _coll(1, B), _coll(2, A))}]
    hit = first_mismatch(logs)
    assert hit is not None
    assert (hit.group, hit.position, hit.rank_a, hit.rank_b) == ("3", 1, 0, 1)
    text = str(hit.error(7))
    assert isinstance(hit.error(7), SMPOrderError)
    for part in ("ranks 0 and 1", "the dp group (group 3, ranks [0, 1])", "position 1",
                 "step 7", "all_reduce([4, 8] float32) [call #1]",
                 "all_reduce([8] float32) [call #1]"):
        assert part in text, (part, text)


@pytest.mark.parametrize("other", [_coll(0, A, root=1), _coll(0, A, op="broadcast"),
                                   Call(0, "all_reduce", COLLECTIVE, A, ("bfloat16",))])
def test_root_op_and_dtype_count(other: Call) -> None:
    logs = [{"3": _log(_coll(0, A, root=0 if other.root is not None else None))},
            {"3": _log(other)}]
    assert first_mismatch(logs) is not None


def test_a_missing_collective_is_named_as_nothing() -> None:
    logs = [{"3": _log(_coll(0, A), _coll(1, A))}, {"3": _log(_coll(0, A))}]
    hit = first_mismatch(logs)
    assert hit is not None and hit.position == 1 and hit.call_b is None
    assert "'rank 1': 'nothing'" in str(hit.error(1))


def test_messages_compared_per_pair_in_order() -> None:
    """Rank 0's second message to rank 1 is not the second buffer rank 1 posted; the
    messages of another pair (0 -> 2) interleaved differently do not matter."""
    sends = _log(Call(0, "send", SEND, A, ("float32",), peer=1),
                 Call(1, "send", SEND, B, ("float32",), peer=2),
                 Call(2, "send", SEND, B, ("float32",), peer=1), ranks=(0, 1, 2))
    recvs = _log(Call(0, "recv", RECV, A, ("float32",), peer=0),
                 Call(1, "recv", RECV, A, ("float32",), peer=0), ranks=(0, 1, 2))
    third = _log(Call(0, "recv", RECV, B, ("float32",), peer=0), ranks=(0, 1, 2))
    hit = first_mismatch([{"9": sends}, {"9": recvs}, {"9": third}])
    assert hit is not None
    assert (hit.what, hit.position, hit.rank_a, hit.rank_b) == (
        "messages from rank 0 to rank 1", 1, 0, 1)


def test_the_earliest_position_across_groups_is_reported() -> None:
    late = [_coll(0, A), _coll(1, A), _coll(2, A)]
    logs = [{"3": _log(*late), "4": _log(_coll(0, A), _coll(1, A))},
            {"3": _log(*late[:2], _coll(2, B)), "4": _log(_coll(0, A), _coll(1, B))}]
    hit = first_mismatch(logs)
    assert hit is not None and (hit.group, hit.position) == ("4", 1)
