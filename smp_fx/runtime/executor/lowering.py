"""Lowering: a schedule becomes this rank's op list, with everything a step needs to run it.

Each action becomes its transfers and itself (``RECV_ACT* F SEND_ACT*``,
``[WAIT_B] RECV_GRAD* B SEND_GRAD*``); ``lower`` is a pure function of (schedule,
program, this rank's stages) and ``LoweredCache``'s fast path relies on
``cached_schedule``. See docs/runtime.md ('Lowering', 'The schedule contract').
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_model import schedule as sched
from passes.split_stages import StagedProgram

OP_KINDS = ("RECV_ACT", "F", "SEND_ACT", "SEND_OUT", "RECV_OUT", "WAIT_B", "RECV_GRAD", "B",
            "I", "W", "SEND_GRAD")
BACKWARD_OPS = ("B", "I")
"""The ops that produce a stage's input gradients (what the stage before waits for)."""


def trains(ops: Sequence[Op]) -> bool:
    """Whether a step's ops run a backward (a B, or a split backward's I)."""
    return any(op.kind in BACKWARD_OPS for op in ops)
# The transport channels: activations (forward), gradients (backward), the last stage's
# outputs (to every other pipeline rank).
CHANNELS = ("act", "grad", "out")
CHANNEL_OF = {"RECV_ACT": "act", "SEND_ACT": "act", "RECV_GRAD": "grad", "SEND_GRAD": "grad",
              "RECV_OUT": "out", "SEND_OUT": "out"}  # the channel of a transfer op

# What each op kind does, in words for error messages and flight records ({peer}: the other
# stage of a transfer, with its rank when known).
OP_WORDS = {
    "RECV_ACT": "receiving the activations of microbatch {mb} from {peer} for its forward pass",
    "F": "the forward pass of microbatch {mb} on stage {stage}",
    "SEND_ACT": "sending the activations of microbatch {mb} to {peer}",
    "SEND_OUT": "sending the model outputs of microbatch {mb} to {peer}",
    "RECV_OUT": "receiving the model outputs of microbatch {mb} from {peer}",
    "WAIT_B": "waiting for microbatch {mb}'s step function to call model.backward or return",
    "RECV_GRAD": "receiving the gradients of microbatch {mb} from {peer} for its backward pass",
    "B": "the backward pass of microbatch {mb} on stage {stage}",
    "I": "the input gradients of microbatch {mb} on stage {stage}",
    "W": "the weight gradients of microbatch {mb} on stage {stage}",
    "SEND_GRAD": "sending the gradients of microbatch {mb} to {peer}",
}

Stream = tuple[int, int, str]  # (sending stage, receiving stage, channel)
Post = tuple[int, int, str, int]  # (sending stage, receiving stage, channel, messages)


@dataclass(frozen=True)
class Op:
    """One lowered step of a rank's work; ``peer`` is the other stage of a transfer.

    >>> str(Op("SEND_ACT", 0, 3, 1)), str(Op("B", 1, 0))
    ('0SEND_ACT3@1', '1B0')
    """

    kind: str
    stage: int
    microbatch: int
    peer: int = -1

    def __str__(self) -> str:
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.stage}{self.kind}{self.microbatch}{peer}"


def stage_name(stage: int, ranks: Sequence[int] | None = None) -> str:
    """``stage 1``, or ``stage 1 (rank 3)`` when the ranks holding the stages are known."""
    return f"stage {stage} (rank {ranks[stage]})" if ranks else f"stage {stage}"


def describe(op: Op, ranks: Sequence[int] | None = None) -> str:
    """``op`` in words; ``ranks[s]``: the global rank holding stage ``s`` (across processes).

    >>> describe(Op("RECV_GRAD", 0, 2, 1), [0, 5])
    'receiving the gradients of microbatch 2 from stage 1 (rank 5) for its backward pass'
    """
    peer = stage_name(op.peer, ranks) if op.peer >= 0 else ""
    return OP_WORDS[op.kind].format(mb=op.microbatch, stage=op.stage, peer=peer)


@dataclass(frozen=True)
class Lowered:
    """A schedule lowered for one rank: its ops, receive streams announced per position
    (``posts``), messages per send stream, the last receive, ``next_forward``, whether it
    may run straight through (across processes: ``straight.py``) and whether its stages
    take ``model(...)``'s arguments (then only with a learned ``straight.ArgMap``)."""

    ops: tuple[Op, ...]
    posts: Mapping[int, tuple[Post, ...]]
    sends: Mapping[Stream, int]
    last_recv: int
    next_forward: tuple[int, ...] | None
    straight: bool = False
    takes_args: bool = False

    def lines(self) -> list[str]:
        """The lowering as text: one line per op, followed by what happens at its position
        (``post grad 1>0 x4``: a receive stream announced before it; ``start mb1``: the
        forward starts microbatch 1's step function; ``last recv``), then one line per send
        stream (``send act 0>1 x4``)."""
        out = []
        for i, op in enumerate(self.ops):
            notes = [f"post {ch} {src}>{dst} x{n}" for src, dst, ch, n in self.posts.get(i, ())]
            if op.kind == "F" and self.next_forward is not None and self.next_forward[i] >= 0:
                notes.append(f"start mb{self.next_forward[i]}")
            if i == self.last_recv:
                notes.append("last recv")
            out.append("  ".join([str(op), *notes]))
        out += [f"send {ch} {src}>{dst} x{n}" for (src, dst, ch), n in self.sends.items()]
        return out


def lower(schedule: sched.Schedule, program: StagedProgram, stages: Sequence[int],
          multi_process: bool) -> Lowered:
    """``schedule`` lowered for the rank holding ``stages`` (its chunks, or all in-process);
    transfers between this rank's own chunks stay in the process."""
    ops = lower_ops(schedule, program, stages, multi_process)
    ahead = multi_process and program.num_stages - 1 not in stages
    local = frozenset(stages) if multi_process else frozenset()
    return Lowered(ops, receive_posts(ops, local), send_counts(ops, local), last_receive(ops),
                   next_forwards(ops) if ahead else None, multi_process,
                   any(program.stages[s].program_inputs for s in stages))


def lower_ops(schedule: sched.Schedule, program: StagedProgram, stages: Sequence[int],
              multi_process: bool) -> tuple[Op, ...]:
    """The op list of ``lower`` (see the module doc)."""
    rank_of = sched.placement_of(schedule)
    last = len(rank_of) - 1
    if multi_process:
        actions: list[sched.Action] = list(schedule[rank_of[stages[0]]])
    else:
        actions = [a for row in sched.clock(schedule) for a in row if a is not None]
    forward_only = all(a.kind == sched.FORWARD for a in actions)
    # who gets the last stage's outputs on their own channel: a stage of every other rank
    # in a forward-only step (its highest); else a stage that sends nothing on, so no
    # gradient message reaches it
    if forward_only:
        out_to = [max(c for c, r in enumerate(rank_of) if r == rank)
                  for rank in sorted(set(rank_of)) if rank != rank_of[last]]
    else:
        out_to = [d for d in range(len(rank_of)) if d != last and not program.stages[d].sends]
    ops: list[Op] = []
    for a in actions:
        st = program.stages[a.stage]
        mb = a.microbatch
        if a.kind == sched.FORWARD:
            ops += [Op("RECV_ACT", a.stage, mb, src) for src, _ in st.recvs]
            ops.append(Op("F", a.stage, mb))
            ops += [Op("SEND_ACT", a.stage, mb, dst) for dst, _ in st.sends]
            if multi_process and a.stage == last:
                ops += [Op("SEND_OUT", a.stage, mb, d) for d in out_to]
        elif a.kind == sched.WEIGHT_GRAD:
            ops.append(Op("W", a.stage, mb))
        else:
            if multi_process and not forward_only and a.stage in out_to:
                ops.append(Op("RECV_OUT", a.stage, mb, last))
            if a.stage == last or not st.sends:
                ops.append(Op("WAIT_B", a.stage, mb))
            ops += [Op("RECV_GRAD", a.stage, mb, dst) for dst, _ in st.sends]
            ops.append(Op(a.kind, a.stage, mb))
            ops += [Op("SEND_GRAD", a.stage, mb, src) for src, _ in st.recvs]
    if multi_process and forward_only and last not in stages:
        mine = max(stages)
        m = sum(1 for a in actions if a.stage == mine)
        ops += [Op("RECV_OUT", mine, mb, last) for mb in range(m)]
    return tuple(ops)


def receive_posts(ops: Sequence[Op], local: frozenset[int] = frozenset()
                  ) -> dict[int, tuple[Post, ...]]:
    """Where each received stream is announced to the transport: op position -> (peer, stage,
    channel, messages this step); before its first receive or right after this rank's
    first send, off the step's start and the fill (docs/performance.md)."""
    first_send = next((i for i, op in enumerate(ops)
                       if op.kind.startswith("SEND") and op.peer not in local), len(ops))
    streams: dict[tuple[int, int, str], list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind.startswith("RECV") and op.peer not in local:
            streams.setdefault((op.peer, op.stage, CHANNEL_OF[op.kind]), []).append(i)
    posts: dict[int, list[Post]] = {}
    for key, where in streams.items():
        posts.setdefault(min(where[0], first_send + 1), []).append((*key, len(where)))
    return {i: tuple(p) for i, p in posts.items()}


def send_counts(ops: Sequence[Op], local: frozenset[int] = frozenset()) -> dict[Stream, int]:
    """How many messages ``ops`` send per (stage, peer, channel) to a stage not in ``local``:
    the transport's receiver counts the same stream from its own ops (``receive_posts``)."""
    counts: dict[Stream, int] = {}
    for op in ops:
        if op.kind.startswith("SEND") and op.peer not in local:
            key = (op.stage, op.peer, CHANNEL_OF[op.kind])
            counts[key] = counts.get(key, 0) + 1
    return counts


def last_receive(ops: Sequence[Op]) -> int:
    """The position of the last receive in ``ops`` (-1: none). After it this rank will not
    wait for a message again this step."""
    return max((i for i, op in enumerate(ops) if op.kind.startswith("RECV")), default=-1)


def next_forwards(ops: Sequence[Op]) -> tuple[int, ...]:
    """For each op position, the microbatch of the next F op after it that starts a
    microbatch on this rank (its first F here; later chunks' forwards of a microbatch the
    rank already holds start nothing), or -1."""
    first: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind == "F":
            first.setdefault(op.microbatch, i)
    starts = set(first.values())
    out, nxt = [-1] * len(ops), -1
    for i in range(len(ops) - 1, -1, -1):
        out[i] = nxt
        if i in starts:
            nxt = ops[i].microbatch
    return tuple(out)


@functools.lru_cache(maxsize=32)
def cached_schedule(pipeline: str, p: int, m: int, active: int, forward_only: bool,
                    virtual: int = 1, placement: tuple[int, ...] | None = None
                    ) -> sched.Schedule:
    """``sched.generate``, once per configuration: the same object every step.

    Contract with ``LoweredCache.get``: it recognises the last step's schedule by identity,
    which hits on every step whose schedule comes from here."""
    return sched.generate(pipeline, p, m, active, forward_only=forward_only,
                          virtual_stages=virtual, placement=placement)


class LoweredCache:
    """``lower`` once per (schedule, stages) of one program and one kind of rank."""

    def __init__(self, program: StagedProgram, multi_process: bool) -> None:
        self.program = program
        self.multi_process = multi_process
        self._by_key: dict[tuple[sched.Schedule, tuple[int, ...]], Lowered] = {}
        self._last: tuple[sched.Schedule | None, tuple[int, ...], Lowered | None] = (
            None, (), None)

    def get(self, schedule: sched.Schedule, stages: tuple[int, ...]) -> Lowered:
        """The lowering of ``schedule`` for ``stages``; the last call's very schedule object is
        found by ``is`` (4-12 us a step saved, docs/performance.md), any other by equality."""
        last_schedule, last_stages, lowered = self._last
        if last_schedule is schedule and last_stages == stages and lowered is not None:
            return lowered
        key = (schedule, stages)
        lowered = self._by_key.get(key)
        if lowered is None:
            lowered = self._by_key[key] = lower(schedule, self.program, stages,
                                                self.multi_process)
        self._last = (schedule, stages, lowered)
        return lowered
