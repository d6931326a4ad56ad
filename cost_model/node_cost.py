"""``NodeCost``: what one fx node costs, the unit every later stage of the compiler sums."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class NodeCost:
    """Cost of one graph node for one microbatch.

    ``param_bytes`` counts each parameter once (at its first reader), so it sums exactly."""

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    param_bytes: int = 0
    output_bytes: int = 0
    saved_bytes: int = 0
    measured: bool = False
    op: str = ""
    known: bool = True

    @property
    def time_s(self) -> float:
        return self.fwd_time_s + self.bwd_time_s

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeCost:
        return cls(**data)
