"""Rank arithmetic: which (pp, tp, rdp, cp) coordinates each global rank has, and the groups.

Pure: no torch.distributed, so every placement can be checked without processes. The
process groups in ``smp_fx.world.state`` are built from the rank lists computed here.

Placement follows SMP's documentation ("Placement Strategy with Tensor Parallelism"): a
``placement_strategy`` is a permutation of the letters D (reduced data parallel), P
(pipeline) and T (tensor); the right-most letter varies fastest over consecutive global
ranks, the left-most slowest. ``"cluster"`` is ``"DPT"`` and ``"spread"`` is ``"TPD"``.

With tp = pp = rdp = 2, ``"DPT"`` gives::

    rank  rdp pp tp          rank  rdp pp tp      ("PTD")
    0     0   0  0           0     0   0  0
    1     0   0  1           1     1   0  0
    2     0   1  0           2     0   0  1
    3     0   1  1           3     1   0  1
    4     1   0  0           4     0   1  0
    ...                      ...

Groups (each a sorted list of global ranks; a rank's index in it is its rank in the group,
the same convention as ``torch.distributed.new_group``):

- ``pp``: same (tp, rdp) coordinates, i.e. one pipeline;
- ``tp``: same (pp, rdp); ``rdp``: same (pp, tp);
- ``dp``: same pp_rank (tp x rdp ranks holding the same pipeline stage);
- ``mp``: same rdp_rank (pp x tp ranks holding one model replica);
- ``world``: everyone.

Context parallelism (``context_parallel_degree``, an smp-fx extension) adds a fourth
letter C that the placement string does not name: it sits immediately left of T, so the
ranks of one cp group are adjacent (strided by tp), inside data parallelism and outside
tensor parallelism (``"DPT"`` runs as ``"DPCT"``). ``cp`` groups share (pp, tp, rdp); every
SMP group above shares the cp coordinate, so ``rdp``/``dp`` count replicas that read
different data and the cp ranks of one replica read the same batch.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from cost_model.errors import SMPConfigError

SCHEMA_VERSION = 1
ALIASES: dict[str, str] = {"cluster": "DPT", "spread": "TPD"}
PERMUTATIONS: tuple[str, ...] = tuple("".join(p) for p in itertools.permutations("DPT"))
AXES: tuple[str, ...] = ("world", "mp", "dp", "pp", "tp", "rdp", "cp")
# Which coordinates a group's members share (placement letters; C is context parallel).
_SHARED: dict[str, str] = {
    "world": "",
    "pp": "TDC",
    "tp": "PDC",
    "rdp": "PTC",
    "dp": "PC",
    "mp": "DC",
    "cp": "PTD",
}

Coords = tuple[int, int, int]  # (pp_rank, tp_rank, rdp_rank)


def normalize_placement(strategy: str) -> str:
    """``"cluster"``/``"spread"``/a permutation of D, P, T -> the permutation, upper-case."""
    if not isinstance(strategy, str):
        raise SMPConfigError.build(
            "placement_strategy must be a string", strategy, "placement_strategy",
            "use 'cluster', 'spread' or a permutation of 'D', 'P', 'T' such as 'DPT'")
    key = strategy.strip()
    if key.lower() in ALIASES:
        return ALIASES[key.lower()]
    if key.upper() in PERMUTATIONS:
        return key.upper()
    raise SMPConfigError.build(
        "placement_strategy must be 'cluster', 'spread' or a permutation of 'D', 'P', 'T'",
        strategy, "placement_strategy", f"use one of cluster, spread, {', '.join(PERMUTATIONS)}")


@dataclass(frozen=True)
class Topology:
    """World = pp_size x tp_size x rdp_size x cp_size ranks laid out by ``placement``.

    >>> t = Topology(pp_size=2, tp_size=1, rdp_size=4, placement="spread")
    >>> t.group("mp", 0), t.group("dp", 6), t.group_rank("dp", 6)
    ([0, 4], [4, 5, 6, 7], 2)
    """

    pp_size: int
    tp_size: int
    rdp_size: int
    placement: str = "DPT"
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pp_size", "tp_size", "rdp_size", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SMPConfigError.build(f"Topology.{name} must be an int >= 1", value,
                                           "Topology", "pass positive degrees")
        object.__setattr__(self, "placement", normalize_placement(self.placement))

    # --- sizes ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size * self.rdp_size * self.cp_size

    @property
    def mp_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def dp_size(self) -> int:
        return self.tp_size * self.rdp_size

    def size(self, axis: str) -> int:
        """Number of ranks in a group of ``axis`` (one of ``AXES``)."""
        return {"world": self.world_size, "mp": self.mp_size, "dp": self.dp_size,
                "pp": self.pp_size, "tp": self.tp_size, "rdp": self.rdp_size,
                "cp": self.cp_size}[_axis(axis)]

    # --- rank <-> coordinates ------------------------------------------------------------
    def _letter_sizes(self) -> dict[str, int]:
        return {"P": self.pp_size, "T": self.tp_size, "D": self.rdp_size, "C": self.cp_size}

    @property
    def order(self) -> str:
        """The placement with C (context parallel) immediately left of T, e.g. ``"DPCT"``."""
        return self.placement.replace("T", "CT")

    def _digits(self, rank: int) -> dict[str, int]:
        self._check_rank(rank)
        sizes = self._letter_sizes()
        digits: dict[str, int] = {}
        rest = rank
        for letter in reversed(self.order):  # right-most letter varies fastest
            digits[letter] = rest % sizes[letter]
            rest //= sizes[letter]
        return digits

    def coords(self, rank: int) -> Coords:
        """(pp_rank, tp_rank, rdp_rank) of global ``rank``."""
        digits = self._digits(rank)
        return digits["P"], digits["T"], digits["D"]

    def cp_coord(self, rank: int) -> int:
        """The context-parallel rank of global ``rank``."""
        return self._digits(rank)["C"]

    def rank_of(self, pp_rank: int, tp_rank: int, rdp_rank: int, cp_rank: int = 0) -> int:
        """The global rank with these coordinates (inverse of ``coords`` and ``cp_coord``)."""
        sizes = self._letter_sizes()
        digits = {"P": pp_rank, "T": tp_rank, "D": rdp_rank, "C": cp_rank}
        for letter, value in digits.items():
            if not 0 <= value < sizes[letter]:
                raise SMPConfigError.build(
                    f"coordinate {letter} must be in [0, {sizes[letter]})", value,
                    "Topology.rank_of", "pass coordinates within the degrees")
        rank = 0
        for letter in self.order:
            rank = rank * sizes[letter] + digits[letter]
        return rank

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise SMPConfigError.build(f"rank must be in [0, {self.world_size})", rank,
                                       "Topology", "pass a global rank of this world")

    # --- groups ----------------------------------------------------------------------------
    def group(self, axis: str, rank: int) -> list[int]:
        """Sorted global ranks of the ``axis`` group that contains ``rank``."""
        shared = _SHARED[_axis(axis)]
        mine = self._digits(rank)
        sizes = self._letter_sizes()
        choices = [(mine[k],) if k in shared else range(sizes[k]) for k in "PTDC"]
        return sorted(self.rank_of(*c) for c in itertools.product(*choices))

    def group_rank(self, axis: str, rank: int) -> int:
        """Rank of ``rank`` inside its ``axis`` group (index in the sorted list)."""
        return self.group(axis, rank).index(rank)

    def groups(self, axis: str) -> list[list[int]]:
        """Every ``axis`` group, ordered by smallest member: the creation order on all ranks."""
        covered: set[int] = set()
        out: list[list[int]] = []
        for r in range(self.world_size):  # ascending, so each group appears at its minimum
            if r not in covered:
                g = self.group(axis, r)
                covered.update(g)
                out.append(g)
        return out

    def table(self) -> str:
        """The table layout of SMP's documentation: one row per rank with rdp, pp and tp ranks."""
        cp = self.cp_size > 1  # the cp column only where context parallelism is on
        rows = ["rank rdp_rank pp_rank tp_rank" + (" cp_rank" if cp else "")]
        for r in range(self.world_size):
            pp, tp, rdp = self.coords(r)
            tail = f"{tp:<7} {self.cp_coord(r)}" if cp else f"{tp}"
            rows.append(f"{r:<4} {rdp:<8} {pp:<7} {tail}")
        return "\n".join(rows)

    # --- serialisation -----------------------------------------------------------------------
    def to_json(self) -> str:
        data = {"schema": SCHEMA_VERSION, "pp_size": self.pp_size, "tp_size": self.tp_size,
                "rdp_size": self.rdp_size, "placement": self.placement}
        if self.cp_size > 1:
            data["cp_size"] = self.cp_size
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        data: dict[str, Any] = json.loads(text)
        if data.get("schema") != SCHEMA_VERSION:
            raise SMPConfigError.build("unsupported Topology schema", data.get("schema"),
                                       "Topology.from_json", f"use schema {SCHEMA_VERSION}")
        return cls(data["pp_size"], data["tp_size"], data["rdp_size"], data["placement"],
                   data.get("cp_size", 1))


def _axis(axis: str) -> str:
    if axis not in _SHARED:
        raise SMPConfigError.build("unknown group axis", axis, "Topology",
                                   f"use one of {', '.join(AXES)}")
    return axis
