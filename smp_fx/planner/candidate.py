"""One configuration the planner may choose, and the ``--fix`` keys that pin parts of it.

A ``Candidate`` is everything a plan decides: the tensor, pipeline and data parallel
degrees, the microbatch size (the count follows from the global batch), the virtual
stages per rank and the schedule, what is recomputed, sequence parallelism and the
sharding of optimizer state or of everything (``zero1``: SMP's ``shard_optimizer_state``;
``fsdp``: ``sharded_data_parallel_degree`` = dp), the expert-parallel degree (``ep``: an ep
group carved out of the dp ranks) and the context-parallel degree (``cp``: GPUs = tp x pp
x cp x dp, each sequence split over the cp ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cost_model.errors import SMPConfigError
from cost_model.memory import ZERO
from cost_model.schedule_cost import SCHEDULES
from smp_fx.planner.profile import RECOMPUTE

FIX_KEYS = ("tp", "pp", "dp", "mbs", "vp", "schedule", "recompute", "sp", "zero", "ep", "cp")
_INTS = ("tp", "pp", "dp", "mbs", "vp", "ep", "cp")


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration (module docstring)."""

    tp: int
    pp: int
    dp: int
    mbs: int
    vp: int
    schedule: str
    recompute: str
    sp: bool
    zero: str
    ep: int = 1
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def label(self) -> str:
        """Short text: ``tp8 pp8 dp2 mbs1 interleaved v2 full sp zero1``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"mbs{self.mbs}",
                 self.schedule + (f" v{self.vp}" if self.vp > 1 else ""),
                 f"rc:{self.recompute}"]
        if self.sp:
            parts.append("sp")
        if self.zero != "none":
            parts.append(self.zero)
        parts.extend(f"{k}{n}" for k, n in (("ep", self.ep), ("cp", self.cp)) if n > 1)
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_fix(text: str | None) -> dict[str, Any]:
    """``"tp=8,pp=8,schedule=interleaved,sp=false"`` -> typed values, every key checked.

    >>> parse_fix("tp=8, pp=4,sp=true,zero=zero1")
    {'tp': 8, 'pp': 4, 'sp': True, 'zero': 'zero1'}
    """
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in FIX_KEYS:
            raise SMPConfigError.build("--fix takes KEY=VALUE pairs with keys "
                                       + ", ".join(FIX_KEYS), item, "--fix",
                                       "write e.g. --fix tp=8,pp=8,schedule=interleaved")
        out[key] = _value(key, value)
    return out


def _value(key: str, value: str) -> Any:
    if key in _INTS:
        if not value.isdigit() or int(value) < 1:
            raise SMPConfigError.build(f"--fix {key} takes an integer >= 1", value,
                                       "--fix", f"write {key}=2")
        return int(value)
    if key == "sp":
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise SMPConfigError.build("--fix sp takes true or false", value, "--fix",
                                       "write sp=true")
        return value.lower() in ("true", "1", "yes")
    choices = {"schedule": SCHEDULES, "recompute": RECOMPUTE, "zero": ZERO}[key]
    if value not in choices:
        raise SMPConfigError.build(f"--fix {key} is one of " + ", ".join(choices), value,
                                   "--fix", f"write {key}={choices[0]}")
    return value


def matches(c: Candidate, fixed: Mapping[str, Any]) -> bool:
    return all(getattr(c, k) == v for k, v in fixed.items())


__all__ = ["FIX_KEYS", "Candidate", "matches", "parse_fix"]
