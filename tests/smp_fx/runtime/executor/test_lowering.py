"""Lowering is data: a schedule lowered for a rank reads as text, and the cache finds the
last step's lowering by the schedule's identity."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from cost_model import schedule as sched
from passes import meta
from passes.split_stages import split_stages
from smp_fx.runtime.executor.lowering import (
    OP_KINDS,
    OP_WORDS,
    LoweredCache,
    Op,
    cached_schedule,
    describe,
    lower,
    next_forwards,
    receive_posts,
)


def _program(p: int) -> Any:
    gm = torch.fx.symbolic_trace(nn.Sequential(*[nn.Linear(4, 4) for _ in range(p)]))
    for n in gm.graph.nodes:
        if n.op == "call_module":
            meta.STAGE.set(n, int(n.target))
    return split_stages(gm)


def test_lowering_adds_the_transfers_each_action_needs() -> None:
    prog = _program(2)
    s = sched.generate("interleaved", 2, 2)
    assert [str(o) for o in lower(s, prog, [0], True).ops] == [
        "0F0", "0SEND_ACT0@1", "0F1", "0SEND_ACT1@1",
        "0RECV_GRAD0@1", "0B0",  # the gradient message decides B and brings the outputs
        "0RECV_GRAD1@1", "0B1"]
    assert [str(o) for o in lower(s, prog, [1], True).ops] == [
        "1RECV_ACT0@0", "1F0", "1WAIT_B0", "1B0", "1SEND_GRAD0@0",
        "1RECV_ACT1@0", "1F1", "1WAIT_B1", "1B1", "1SEND_GRAD1@0"]
    fwd = sched.generate("simple", 2, 2, forward_only=True)
    assert [str(o) for o in lower(fwd, prog, [0], True).ops] == [
        "0F0", "0SEND_ACT0@1", "0F1", "0SEND_ACT1@1", "0RECV_OUT0@1", "0RECV_OUT1@1"]
    assert [str(o) for o in lower(fwd, prog, [1], True).ops] == [
        "1RECV_ACT0@0", "1F0", "1SEND_OUT0@0", "1RECV_ACT1@0", "1F1", "1SEND_OUT1@0"]
    # in-process: the stages' lists merged in lock-step clock order, no output transfers
    merged = lower(s, prog, [0, 1], False).ops
    ticks = [a for row in sched.clock(s) for a in row if a is not None]
    assert [o for o in merged if o.kind in ("F", "B")] == [
        Op(a.kind, a.stage, a.microbatch) for a in ticks]
    assert [str(a) for a in ticks][:4] == ["0F0", "0F1", "1F0", "1B0"]
    assert not any("OUT" in o.kind for o in merged)


def test_a_lowering_reads_as_text_with_everything_a_step_needs() -> None:
    prog = _program(2)
    s = sched.generate("interleaved", 2, 3)
    # the first stage starts step functions a forward ahead (its model(...) calls wait for
    # outputs computed elsewhere), announces its gradient stream after its first send
    assert lower(s, prog, [0], True).lines() == [
        "0F0  start mb1", "0SEND_ACT0@1", "0F1  post grad 1>0 x3  start mb2", "0SEND_ACT1@1",
        "0RECV_GRAD0@1", "0B0", "0F2", "0SEND_ACT2@1", "0RECV_GRAD1@1", "0B1",
        "0RECV_GRAD2@1  last recv", "0B2",
        "send act 0>1 x3"]
    # the last stage starts none ahead; its first op is a receive, announced right there
    assert lower(s, prog, [1], True).lines() == [
        "1RECV_ACT0@0  post act 0>1 x3", "1F0", "1WAIT_B0", "1B0", "1SEND_GRAD0@0",
        "1RECV_ACT1@0", "1F1", "1WAIT_B1", "1B1", "1SEND_GRAD1@0",
        "1RECV_ACT2@0  last recv", "1F2", "1WAIT_B2", "1B2", "1SEND_GRAD2@0",
        "send grad 1>0 x3"]
    fwd = sched.generate("simple", 2, 2, forward_only=True)
    assert lower(fwd, prog, [0], True).lines() == [
        "0F0  start mb1", "0SEND_ACT0@1", "0F1  post out 1>0 x2", "0SEND_ACT1@1",
        "0RECV_OUT0@1", "0RECV_OUT1@1  last recv",
        "send act 0>1 x2"]
    # in-process every step function runs here: none is started ahead
    assert lower(fwd, prog, [0, 1], False).lines() == [
        "0F0", "0SEND_ACT0@1", "0F1  post act 0>1 x2", "0SEND_ACT1@1",
        "1RECV_ACT0@0", "1F0", "1RECV_ACT1@0  last recv", "1F1",
        "send act 0>1 x2"]


def test_receive_streams_are_announced_right_after_the_first_send() -> None:
    prog = _program(2)
    s = sched.generate("interleaved", 2, 4)
    ops0 = lower(s, prog, [0], True).ops
    # stage 0 receives only gradients: announced right after its first send (F0's)
    assert receive_posts(ops0) == {2: ((1, 0, "grad", 4),)} and ops0[1].kind == "SEND_ACT"
    # stage 1's first op is a receive: announced there, counting every message
    assert lower(s, prog, [1], True).posts == {0: ((0, 1, "act", 4),)}


def test_next_forwards_names_the_first_forward_after_each_position() -> None:
    ops = [Op("F", 0, 0), Op("SEND_ACT", 0, 0, 1), Op("B", 0, 0), Op("F", 0, 2), Op("B", 0, 2)]
    assert next_forwards(ops) == (2, 2, 2, -1, -1)


def test_the_cache_finds_the_last_schedule_by_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    prog = _program(2)
    cache = LoweredCache(prog, multi_process=True)
    s = cached_schedule("interleaved", 2, 4, 4, False)
    assert cached_schedule("interleaved", 2, 4, 4, False) is s  # the contract the cache uses
    first = cache.get(s, (0,))
    assert first.ops == lower(s, prog, [0], True).ops

    def no_hash(self: Any) -> int:
        raise AssertionError("the schedule was hashed")

    monkeypatch.setattr(sched.Action, "__hash__", no_hash)
    assert cache.get(s, (0,)) is first  # the same object: no hashing
    monkeypatch.undo()
    equal = sched.generate("interleaved", 2, 4, 4)
    assert equal is not s and cache.get(equal, (0,)) is first  # an equal one: by hash
    assert cache.get(s, (1,)).ops[0] == Op("RECV_ACT", 1, 0, 0)  # other stages: their own


def test_every_op_kind_reads_in_words() -> None:
    assert set(OP_WORDS) == set(OP_KINDS)
    ops = [Op("RECV_ACT", 1, 2, 0), Op("F", 1, 2), Op("SEND_ACT", 1, 2, 2),
           Op("SEND_OUT", 2, 0, 0), Op("RECV_OUT", 0, 1, 2), Op("WAIT_B", 2, 3),
           Op("RECV_GRAD", 1, 2, 2), Op("B", 1, 2), Op("SEND_GRAD", 1, 2, 0)]
    assert [describe(op, [4, 5, 6]) for op in ops] == [
        "receiving the activations of microbatch 2 from stage 0 (rank 4) for its forward pass",
        "the forward pass of microbatch 2 on stage 1",
        "sending the activations of microbatch 2 to stage 2 (rank 6)",
        "sending the model outputs of microbatch 0 to stage 0 (rank 4)",
        "receiving the model outputs of microbatch 1 from stage 2 (rank 6)",
        "waiting for microbatch 3's step function to call model.backward or return",
        "receiving the gradients of microbatch 2 from stage 2 (rank 6) for its backward pass",
        "the backward pass of microbatch 2 on stage 1",
        "sending the gradients of microbatch 2 to stage 0 (rank 4)"]
    words = describe(Op("SEND_ACT", 0, 1, 1))
    assert words == "sending the activations of microbatch 1 to stage 1"


def test_chunks_of_one_rank_and_a_split_backward_as_text() -> None:
    prog = _program(4)
    s = sched.generate("zbv", 2, 2, virtual_stages=2)
    assert sched.format_schedule(s) == [
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
        "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1"]
    # rank 1 holds chunks 1 and 2 of the V: 1 -> 2 is handed over in the process, so it is
    # no stream of the transport's (no post, no send count); I sends its gradients on at
    # once, W sends nothing; a forward starts the step function of the next new microbatch
    assert lower(s, prog, [1, 2], True).lines() == [
        "1RECV_ACT0@0  post act 0>1 x2", "1F0  start mb1", "1SEND_ACT0@2", "2RECV_ACT0@1",
        "2F0  start mb1", "2SEND_ACT0@3", "1RECV_ACT1@0  post grad 3>2 x2", "1F1",
        "1SEND_ACT1@2", "2RECV_ACT1@1", "2F1", "2SEND_ACT1@3", "2RECV_GRAD0@3", "2I0",
        "2SEND_GRAD0@1", "2W0", "1RECV_GRAD0@2", "1I0", "1SEND_GRAD0@0", "1W0",
        "2RECV_GRAD1@3", "2I1", "2SEND_GRAD1@1", "2W1", "1RECV_GRAD1@2  last recv", "1I1",
        "1SEND_GRAD1@0", "1W1",
        "send act 2>3 x2", "send grad 1>0 x2"]
    # rank 0 holds the first and the last chunk: the loss's decision waits at 3I0
    assert [str(o) for o in lower(s, prog, [0, 3], True).ops][4:9] == [
        "3RECV_ACT0@2", "3F0", "3WAIT_B0", "3I0", "3SEND_GRAD0@2"]
    # in-process every chunk is here: the lists merged in clock order, I and W included
    merged = lower(s, prog, [0, 1, 2, 3], False).ops
    ticks = [a for row in sched.clock(s) for a in row if a is not None]
    assert [o for o in merged if o.kind in "FIWB"] == [
        Op(a.kind, a.stage, a.microbatch) for a in ticks]


def test_round_robin_chunks_lower_per_rank() -> None:
    prog = _program(4)
    s = sched.generate("interleaved", 2, 2, virtual_stages=2)
    ops = lower(s, prog, [0, 2], True)
    # both of rank 0's gradient streams come from rank 1 (chunks 1 and 3): two streams
    assert ops.lines()[:3] == [
        "0F0  start mb1", "0SEND_ACT0@1", "0F1  post act 1>2 x2  post grad 3>2 x2  post grad "
        "1>0 x2"]
    assert dict(ops.sends) == {(0, 1, "act"): 2, (2, 3, "act"): 2, (2, 1, "grad"): 2}
    fwd = sched.generate("zbv", 2, 2, virtual_stages=2, forward_only=True)
    # evaluation: the last chunk's outputs reach rank 1 on their own channel, at its
    # highest chunk
    assert [str(o) for o in lower(fwd, prog, [1, 2], True).ops][-2:] == [
        "2RECV_OUT0@3", "2RECV_OUT1@3"]
