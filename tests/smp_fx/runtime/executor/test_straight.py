"""Straight-through steps (``smp_fx.runtime.executor.straight``): which ranks run them, the
modes their forwards take, and the conductor running a middle rank's ops and step
functions on the calling thread, with every step function's misstep an error raised
after this rank's ops (so its peers get every message). Across processes:
tests/smp_fx/test_schedules.py and test_straight_dist.py (GPT-2, the errors)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from cost_model import schedule as sched
from cost_model.errors import SMPRuntimeError
from smp_fx.runtime.executor.conductor import Conductor
from smp_fx.runtime.executor.lowering import Op, lower
from smp_fx.runtime.executor.straight import ArgMap, ModeMemo, Pieces
from smp_fx.runtime.executor.turns import Microbatch
from smp_fx.world import context
from tests.smp_fx.runtime.executor.test_lowering import _program


def test_every_rank_runs_straight_the_first_stages_with_its_arguments_learned() -> None:
    prog = _program(4)
    for name, fwd in (("interleaved", False), ("simple", True), ("zero_bubble", False)):
        s = sched.generate(name, 4, 4, forward_only=fwd)
        low = [lower(s, prog, [r], True) for r in range(4)]
        assert [(x.straight, x.takes_args) for x in low] == [
            (True, True), (True, False), (True, False), (True, False)], name
        assert not lower(s, prog, [0, 1, 2, 3], False).straight  # one process: no peers
    v = _program(8)
    zbv = sched.generate("zbv", 4, 4, virtual_stages=2)
    # V placement: rank 0 holds the first and the last stage
    assert [lower(zbv, v, [r, 7 - r], True).takes_args for r in range(4)] == [
        True, False, False, False]


def test_the_memo_keeps_modes_only_when_every_call_agreed() -> None:
    memo, launch = ModeMemo(), (True, ())
    def fn() -> None: ...
    def other() -> None: ...
    assert memo.get(fn, launch) is None and not memo.known(fn, launch)
    memo.learn(fn, launch, [(True, ()), (True, ())])
    assert memo.get(fn, launch) == ((True, ()), None)
    memo.learn(other, launch, [(True, ()), (False, ())])
    assert memo.known(other, launch) and memo.get(other, launch) is None
    assert memo.get(fn, (False, ())) is None  # other launch modes: learned anew
    memo.learn(other, (False, ()), [(True, ()), None])  # a microbatch made no call
    assert memo.get(other, (False, ())) is None


# A middle rank of 1F1B with 2 microbatches: its outputs arrive on the gradient messages.
OPS = tuple(Op(k, 1, mb, p) for k, mb, p in (
    ("RECV_ACT", 0, 0), ("F", 0, -1), ("SEND_ACT", 0, 2), ("RECV_ACT", 1, 0), ("F", 1, -1),
    ("SEND_ACT", 1, 2), ("RECV_GRAD", 0, 2), ("B", 0, -1), ("SEND_GRAD", 0, 0),
    ("RECV_GRAD", 1, 2), ("B", 1, -1), ("SEND_GRAD", 1, 0)))


def _conductor(log: list[str]) -> Conductor:
    """Ops that log themselves; a receive lets held-back step functions run first (the
    transport's ``on_block``), a gradient message brings the outputs."""
    def execute(i: int, op: Op) -> None:
        if op.kind.startswith("RECV"):
            c.flush()
        if op.kind == "F":
            req = c.forward_of(op.microbatch, op.stage)
            log.append(f"F{op.microbatch} grad={req.grad_enabled}")
            return
        log.append(str(op))
        if op.kind == "RECV_GRAD":
            c.publish_outputs(op.microbatch, f"out{op.microbatch}", hand=False, defer=True)
        if op.kind == "B":
            c.publish_backward_done(op.microbatch)
    c = Conductor(execute, timeout_s=10)
    return c


def _call(x: Any) -> Any:
    taker, mb = context.turn()  # type: ignore[misc]
    return taker.forward_request(mb, (x,), {})


def test_a_middle_rank_runs_its_ops_and_step_functions_on_the_calling_thread() -> None:
    log: list[str] = []
    c = _conductor(log)

    def fn(x: int) -> tuple[str, str]:
        out = _call(x)
        taker, mb = context.turn()  # type: ignore[misc]
        taker.backward_request(mb, out, None)
        log.append(f"fn{x}")
        return out, threading.current_thread().name

    me = threading.current_thread().name
    results, asked = c.run(fn, [((0,), {}), ((1,), {})], OPS, straight=((True, ()), None))
    assert results == [("out0", me), ("out1", me)] and asked == [True, True]
    assert c.threads_started == 0 and c.straight_steps == 1
    assert c.last_calls == [(True, ()), (True, ())]
    # microbatch 0's function runs when the next receive would block, 1's after the ops
    assert log == ["1RECV_ACT0@0", "F0 grad=True", "1SEND_ACT0@2", "1RECV_ACT1@0",
                   "F1 grad=True", "1SEND_ACT1@2", "1RECV_GRAD0@2", "1B0", "1SEND_GRAD0@0",
                   "fn0", "1RECV_GRAD1@2", "1B1", "1SEND_GRAD1@0", "fn1"]
    with torch.no_grad():  # an evaluation step: the forwards take the learned modes
        log.clear()
        results, asked = c.run(lambda x: _call(x), [((0,), {}), ((1,), {})], OPS,
                               straight=((False, ()), None))
    assert results == ["out0", "out1"] and asked == [False, False]
    assert "F0 grad=False" in log
    bf16 = (True, (("cpu", torch.bfloat16),))  # a first step that called under autocast

    def amp(x: int) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _call(x)

    assert c.run(amp, [((0,), {}), ((1,), {})], OPS,
                 straight=(bf16, None))[0] == ["out0", "out1"]
    with pytest.raises(SMPRuntimeError, match=r"autocast \[\].*autocast \[\('cpu', torch"):
        c.run(_call, [((0,), {}), ((1,), {})], OPS, straight=(bf16, None))


def _fails(fn: Any, match: str) -> list[str]:
    log: list[str] = []
    with pytest.raises(SMPRuntimeError if match else ValueError, match=match or "mine"):
        _conductor(log).run(fn, [((0,), {}), ((1,), {})], OPS, straight=((True, ()), None))
    return log


def test_a_step_function_that_calls_the_model_otherwise_fails_after_every_op() -> None:
    def no_grad(x: int) -> Any:
        with torch.no_grad():
            return _call(x)

    def swallowed(x: int) -> Any:
        try:
            return no_grad(x)
        except SMPRuntimeError:
            return None

    def twice(x: int) -> Any:
        return _call(x), _call(x)

    def boom(x: int) -> Any:
        _call(x)
        raise ValueError("mine")

    rule = r"same torch.no_grad/autocast in every step.*grad enabled False.*rank 0 microbatch 0"
    for fn, match in ((no_grad, rule), (swallowed, rule), (lambda x: x, "without calling"),
                      (twice, "called once per microbatch"), (boom, "")):
        log = _fails(fn, match)
        assert log[-1] == "1SEND_GRAD1@0", fn  # this rank's peers got every message


def test_an_arg_map_rebuilds_the_call_from_the_microbatch_and_catches_strays() -> None:
    x, mask = torch.ones(2, 3), torch.zeros(2, 3)
    micro: Microbatch = (("model", {"ids": x, "mask": mask}), {"labels": None})
    pieces = Pieces.of(micro)
    call = ((x,), {"attention_mask": mask, "use_cache": False})
    m = ArgMap.learn(call, pieces)
    assert m is not None and m.agree(ArgMap.learn(call, pieces))
    args, kwargs = m.build(pieces)
    assert args[0] is x and kwargs["attention_mask"] is mask and kwargs["use_cache"] is False
    assert type(args) is tuple and list(kwargs) == ["attention_mask", "use_cache"]
    assert m.matches(call, pieces)
    assert not m.matches(((x,), {"attention_mask": mask, "use_cache": True}), pieces)
    assert not m.matches(((mask,), {"attention_mask": x, "use_cache": False}), pieces)
    assert not m.matches(((x.clone(),), {"attention_mask": mask, "use_cache": False}), pieces)
    as_list: Any = ([x], {"attention_mask": mask, "use_cache": False})
    assert not m.matches(as_list, pieces)
    assert not m.agree(ArgMap.learn(((x,), {"attention_mask": mask, "use_cache": True}),
                                    pieces))
    x.mul_(2)  # changed in place after the forwards took it
    assert not m.matches(call, pieces)
    # what is not the microbatch's own, as the step began, is not learned
    assert ArgMap.learn(call, pieces) is None  # x changed in place since
    assert ArgMap.learn(((x.float(),), {}), Pieces.of(micro)) is not None  # float: itself
    assert ArgMap.learn(((x + 1,), {}), Pieces.of(micro)) is None


def test_the_memo_keeps_a_map_only_when_every_microbatch_agreed() -> None:
    memo, launch, x = ModeMemo(), (True, ()), torch.ones(1)
    def fn() -> None: ...
    micro: Microbatch = ((x,), {})
    m = ArgMap.learn(((x,), {}), Pieces.of(micro))
    memo.learn(fn, launch, [(True, ())] * 2, [m, m])
    assert memo.get(fn, launch) == ((True, ()), m)
    memo.learn(fn, launch, [(True, ())] * 2, [m, None])
    assert memo.get(fn, launch) == ((True, ()), None)
    memo.forget(fn, launch)
    assert not memo.known(fn, launch)


# The first stage's rank of 1F1B with 2 microbatches: its forwards take model(...)'s
# arguments, built from the microbatch by the learned map; outputs come with the gradients.
FIRST = tuple(Op(k, 0, mb, p) for k, mb, p in (
    ("F", 0, -1), ("SEND_ACT", 0, 1), ("F", 1, -1), ("SEND_ACT", 1, 1),
    ("RECV_GRAD", 0, 1), ("B", 0, -1), ("RECV_GRAD", 1, 1), ("B", 1, -1)))


def test_the_first_stage_runs_straight_with_its_learned_arguments() -> None:
    log: list[str] = []
    c = _conductor(log)
    seen: list[Any] = []  # each forward's model(...) arguments
    logged = c._execute

    def execute(i: int, op: Op) -> None:
        if op.kind == "F":
            seen.append(c.forward_of(op.microbatch, op.stage).args)
        logged(i, op)

    c._execute = execute
    micro: list[Microbatch] = [((torch.ones(1),), {}), ((torch.zeros(1),), {})]
    c.run(_call, micro, FIRST, learn_args=True)  # threaded: learns the map
    maps = c.last_maps
    assert c.straight_steps == 0 and all(m is not None for m in maps)
    learned = ((True, ()), maps[0])
    seen.clear()
    assert c.run(_call, micro, FIRST, straight=learned)[0] == ["out0", "out1"]
    assert c.threads_started == 1 and c.straight_steps == 1
    assert [a[0][0] for a in seen] == [micro[0][0][0], micro[1][0][0]]  # the very tensors
    assert not c.args_strayed

    def cast(x: torch.Tensor) -> Any:
        return _call(x.double())

    with pytest.raises(SMPRuntimeError, match="microbatch's own tensors, unchanged"):
        c.run(cast, micro, FIRST, straight=learned)
    assert c.args_strayed and c.ops_done  # every op ran: the peers got their messages
