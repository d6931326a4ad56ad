"""The conductor's words for a moment of the step (``smp_fx.runtime.executor.turns``): what a
timeout
and the flight record tell a person, compared as whole lines."""

from __future__ import annotations

from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.turns import Request, StepView, Turn, next_op_words, status_lines


def _req() -> Request:
    return Request(((), {}), True, ())


def _view(ops: tuple[Op, ...], nxt: int, turns: list[Turn], started: list[bool],
          done: list[bool], performing: bool = False) -> StepView:
    def runnable(op: Op) -> bool:  # the conductor's rule, as Conductor._runnable states it
        t = turns[op.microbatch]
        if op.kind == "F":
            return t.f_request is not None or done[op.microbatch]
        if op.kind == "WAIT_B":
            return t.b_request is not None or done[op.microbatch]
        return True
    return StepView(ops, nxt, performing, turns, started, done, runnable)


OPS = (Op("F", 0, 0), Op("F", 0, 1), Op("WAIT_B", 0, 0), Op("B", 0, 0))


def test_every_step_function_state_in_words() -> None:
    asked_b = Turn(_req(), _req(), outputs_ready=True)
    turns = [Turn(), Turn(_req()), Turn(_req(), outputs_ready=True),
             Turn(_req(), outputs_ready=True), asked_b, Turn(_req(), _req(), None, True, True)]
    view = _view(OPS, 0, turns, [False] + [True] * 5, [False] * 6)
    assert status_lines(view, str)[1] == (
        "step functions: mb0 not started; mb1 waiting in model(...) for its outputs; "
        "mb2 running user code after model(...); mb3 running user code after model(...); "
        "mb4 waiting for its backward turn; mb5 backward done")
    view = _view(OPS, 0, [Turn(_req())], [True], [True])
    assert status_lines(view, str)[1] == "step functions: mb0 returned"


def test_what_keeps_the_next_op() -> None:
    words = lambda op: f"<{op.kind}>"  # noqa: E731
    started = [True, True]
    view = _view(OPS, 0, [Turn(), Turn()], started, [False, False])
    assert next_op_words(view, words) == ("next op 0F0: <F>, waiting for microbatch 0's step "
                                          "function to call model(...)")
    view = _view(OPS, 2, [Turn(_req(), outputs_ready=True), Turn()], started, [False, False])
    assert next_op_words(view, words) == (
        "next op 0WAIT_B0: <WAIT_B>, waiting for microbatch 0's step function")
    view = _view(OPS, 3, [Turn(_req()), Turn(_req(), outputs_ready=True)], started,
                 [False, False])
    assert next_op_words(view, words) == (
        "next op 0B0: <B>, runnable, but every thread that could perform it runs user code "
        "(step functions of microbatches [1])")
    view = _view(OPS, 3, [Turn(), Turn()], started, [False, False], performing=True)
    assert next_op_words(view, words) == "next op 0B0: <B>, being performed"
    view = _view(OPS, 4, [Turn(), Turn()], started, [True, True])
    assert next_op_words(view, words) == "every op of the step is done"
