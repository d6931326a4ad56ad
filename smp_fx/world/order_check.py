"""The rule NCCL enforces by hanging, written as a comparison of every rank's calls.

On NCCL, the ranks of a process group must issue the same collectives in the same order,
and between two ranks of a group the i-th send of one must meet the i-th receive of the
other, with the same shapes and dtypes. ``first_mismatch`` takes each rank's calls per
group (recorded by ``smp_fx.world.order_mode``) and returns the first place where that
rule breaks; every rank runs it on the same gathered records, so all reach one verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_model.errors import SMPOrderError

SEND, RECV, COLLECTIVE = "send", "recv", "collective"


@dataclass(frozen=True)
class Call:
    """One call a rank issued on a group. ``seq``: its number among this rank's calls on
    the group since ``smp.init``; ``peer``: the other rank (global) of a send or receive;
    ``root``: the source or destination of a rooted collective (its rank in the group);
    ``site``: the line that issued it, outside torch, which tells apart two collectives of
    one shape issued in swapped order. What must match across ranks is everything but
    ``seq`` (``key``), and for a send and its receive their tensors only."""

    seq: int
    op: str
    kind: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    peer: int | None = None
    root: int | None = None
    site: str = ""

    def key(self) -> tuple[object, ...]:
        if self.kind != COLLECTIVE:  # a send meets a receive: their tensors must agree
            return (self.shapes, self.dtypes)
        return (self.op, self.shapes, self.dtypes, self.root, self.site)

    def __str__(self) -> str:
        shapes = ", ".join(f"{list(s)} {d}" for s, d in zip(self.shapes, self.dtypes))
        peer = f" {'to' if self.kind == SEND else 'from'} rank {self.peer}" \
            if self.peer is not None else ""
        root = f" root {self.root}" if self.root is not None else ""
        site = f" at {self.site}" if self.site else ""
        return f"{self.op}({shapes}){peer}{root}{site} [call #{self.seq}]"


@dataclass(frozen=True)
class GroupLog:
    """A rank's calls on one group (named as torch names it, the same on every rank)."""

    ranks: tuple[int, ...]
    label: str
    calls: tuple[Call, ...]


RankLog = Mapping[str, GroupLog]  # group name -> this rank's calls on it


@dataclass(frozen=True)
class Mismatch:
    """Where two ranks disagree: ``position`` in the sequence compared (the group's
    collectives, or the messages from ``sender`` to ``receiver``), and both calls (None:
    the rank issued none there)."""

    group: str
    label: str
    ranks: tuple[int, ...]
    what: str
    position: int
    rank_a: int
    call_a: Call | None
    rank_b: int
    call_b: Call | None

    def order(self) -> tuple[int, int, str]:
        seqs = [c.seq for c in (self.call_a, self.call_b) if c is not None]
        return (self.position, min(seqs, default=0), self.group)

    def error(self, step: int) -> SMPOrderError:
        calls = {f"rank {self.rank_a}": str(self.call_a or "nothing"),
                 f"rank {self.rank_b}": str(self.call_b or "nothing")}
        return SMPOrderError.build(
            f"ranks {self.rank_a} and {self.rank_b} issued different {self.what} on one "
            "process group (NCCL would hang or mix the data; gloo let it pass)", calls,
            f"{self.label} (group {self.group}, ranks {list(self.ranks)}), position "
            f"{self.position} of the calls since the last check, step {step}",
            "make every rank of the group issue the same collectives, and each pair the same "
            "sends and receives, in the same order (docs/runtime.md, 'Checking NCCL's order')")


def _first_difference(seqs: Mapping[int, Sequence[Call]], what: str, log: GroupLog,
                      name: str) -> Mismatch | None:
    """The first position where a rank's call differs from the lowest rank's."""
    ranks = sorted(seqs)
    ref = ranks[0]
    for i in range(max(len(s) for s in seqs.values())):
        a = seqs[ref][i] if i < len(seqs[ref]) else None
        for r in ranks[1:]:
            b = seqs[r][i] if i < len(seqs[r]) else None
            if a is None or b is None or a.key() != b.key():
                return Mismatch(name, log.label, log.ranks, what, i, ref, a, r, b)
    return None


def _group_mismatches(name: str, logs: Mapping[int, GroupLog]) -> list[Mismatch]:
    some = next(iter(logs.values()))
    members = some.ranks
    calls = {r: logs[r].calls if r in logs else () for r in members}
    found = []
    coll = {r: [c for c in cs if c.kind == COLLECTIVE] for r, cs in calls.items()}
    hit = _first_difference(coll, "collectives", some, name)
    if hit is not None:
        found.append(hit)
    for src in members:
        for dst in members:
            sends = [c for c in calls[src] if c.kind == SEND and c.peer == dst]
            recvs = [c for c in calls[dst] if c.kind == RECV and c.peer == src]
            if not sends and not recvs:
                continue
            pair = {src: sends, dst: recvs} if src < dst else {dst: recvs, src: sends}
            hit = _first_difference(pair, f"messages from rank {src} to rank {dst}", some,
                                    name)
            if hit is not None:
                found.append(hit)
    return found


def first_mismatch(logs: Sequence[RankLog]) -> Mismatch | None:
    """The earliest disagreement among ``logs`` (``logs[r]``: world rank ``r``'s record),
    by position, then call number, then group name; None when every group agrees."""
    by_group: dict[str, dict[int, GroupLog]] = {}
    for rank, log in enumerate(logs):
        for name, group_log in log.items():
            by_group.setdefault(name, {})[rank] = group_log
    found = [m for name in sorted(by_group) for m in _group_mismatches(name, by_group[name])]
    return min(found, key=Mismatch.order, default=None)
