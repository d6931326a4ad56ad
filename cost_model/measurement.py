"""A measured training step of a real run, as data: what ``smp-fx plan --measured`` refits on.

Why a file: the cluster a user trains on is the one fact a plan cannot know in advance. One
real run's figures (``smp.write_measurement``) carry its configuration, its step time and
the time of each action of the flight record per rank, so a later plan can be refitted to
that cluster (``cost_model.refit``). See docs/planning.md, 'Learning from a measured run'.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cost_model.errors import SMPConfigError
from cost_model.schedule import default_placement

SCHEMA_VERSION = 1

Action = tuple[str, int, float, float]
"""(op kind, stage, median seconds per step in that kind on that stage, ops per step)."""


@dataclass(frozen=True)
class MeasuredConfig:
    """The configuration that ran, in the planner's terms (``smp_fx.planner.candidate``)."""

    world: int
    tp: int
    pp: int
    dp: int
    mbs: int
    microbatches: int
    vp: int
    schedule: str
    recompute: str
    sp: bool
    zero: str
    precision: str
    device: str
    """The spec name a plan prices it with (``cpu``, ``h100``, ...)."""
    hardware: str = ""

    @property
    def global_batch(self) -> int:
        return self.mbs * self.microbatches * self.dp

    def fix(self) -> dict[str, Any]:
        """Every ``--fix`` key: the plan priced is the run measured."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "mbs": self.mbs, "vp": self.vp,
                "schedule": self.schedule, "recompute": self.recompute, "sp": self.sp,
                "zero": self.zero}


@dataclass(frozen=True)
class RankFigures:
    """One rank's medians over the measured steps."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    step_time_s: float
    """From one step's start to the next one's: the whole iteration as the script runs it."""
    actions: tuple[Action, ...]
    receiving_s: float
    reducing_s: float
    """The data-parallel reduction not hidden by the backward (its post-step hooks too)."""
    peak_memory_bytes: int
    memory_kind: str
    """``cuda_max_allocated`` or ``peak_rss`` (a CPU process: the whole runtime)."""

    def action_s(self, kind: str) -> tuple[float, float]:
        """(seconds per step, ops per step) of ``kind`` over this process's stages."""
        rows = [(t, n) for k, _, t, n in self.actions if k == kind]
        return sum(t for t, _ in rows), sum(n for _, n in rows)


@dataclass(frozen=True)
class Measurement:
    """A measured run (module docstring); ``step_time_s`` is the slowest rank's median."""

    config: MeasuredConfig
    steps: int
    step_time_s: float
    ranks: tuple[RankFigures, ...]

    def by_pp_rank(self, kind: str) -> list[float]:
        """Seconds per microbatch of op ``kind`` on each pipeline rank, over its chunks (the
        schedule's placement: one process may hold every stage); the median over the
        processes holding them (tensor and data parallel replicas)."""
        cfg = self.config
        owner = default_placement(cfg.schedule, cfg.pp, cfg.vp)
        per: dict[int, list[float]] = {}
        for rf in self.ranks:
            mine: dict[int, float] = {}
            for k, stage, t, _ in rf.actions:
                if k == kind and stage < len(owner):
                    mine[owner[stage]] = mine.get(owner[stage], 0.0) + t / cfg.microbatches
            for r, t in mine.items():
                per.setdefault(r, []).append(t)
        return [statistics.median(per[r]) if r in per else 0.0 for r in range(cfg.pp)]

    def per_op(self, kinds: tuple[str, ...]) -> float:
        """The median over ranks of seconds per op of ``kinds`` (0 when none ran)."""
        vals = []
        for rf in self.ranks:
            t = sum(rf.action_s(k)[0] for k in kinds)
            n = sum(rf.action_s(k)[1] for k in kinds)
            if n > 0:
                vals.append(t / n)
        return statistics.median(vals) if vals else 0.0

    def reducing_s(self) -> float:
        return max((rf.reducing_s for rf in self.ranks), default=0.0)

    def peak_memory_bytes(self) -> int:
        return max((rf.peak_memory_bytes for rf in self.ranks), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        d = dict(data)
        version = d.pop("schema_version", None)
        where = "Measurement.from_json"
        if version != SCHEMA_VERSION:
            raise SMPConfigError.build("unsupported measurement schema_version", version, where,
                                       "write it again with smp.write_measurement")
        try:
            ranks = tuple(RankFigures(**{**r, "actions": tuple(
                (str(k), int(s), float(t), float(n)) for k, s, t, n in r["actions"])})
                for r in d["ranks"])
            return cls(MeasuredConfig(**d["config"]), int(d["steps"]),
                       float(d["step_time_s"]), ranks)
        except (KeyError, TypeError, ValueError) as exc:
            raise SMPConfigError.build("a measurement file has exactly the documented fields",
                                       str(exc), where, "write it with smp.write_measurement"
                                       ) from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Measurement:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise SMPConfigError.build("--measured takes a file smp.write_measurement wrote",
                                       str(exc), str(p), "check the path") from exc
        if not isinstance(data, dict):
            raise SMPConfigError.build("a measurement file holds a JSON object",
                                       type(data).__name__, str(p),
                                       "write it with smp.write_measurement")
        return cls.from_json(data)


__all__ = ["Action", "MeasuredConfig", "Measurement", "RankFigures"]
