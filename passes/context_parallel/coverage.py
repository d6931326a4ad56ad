"""What the context-parallel rewrite did to a graph: its plan and coverage report.

``DistributedModel`` logs the report once (rank 0). Anything the rewrite could not split
correctly is not in a plan: the rewrite refuses the graph instead (``rewrite``).

>>> print(ContextParallelPlan(2, ("ids",), ("sdpa",), ("cos",), ("logits",)).text())
context parallelism at degree 2: 1 input split, 1 attention gathering keys and values
  split inputs: ids
  attention: sdpa
  whole values cut to local rows: cos
  outputs gathered: logits
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ContextParallelPlan:
    """The rewrite's result: degree, inputs split, attention nodes replaced, whole
    values cut to local rows where they meet local tokens, outputs gathered."""

    degree: int
    split: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    localized: tuple[str, ...] = ()
    gathered: tuple[str, ...] = ()
    small_kv: tuple[str, ...] = ()
    """Grouped-query keys and values gathered before their repeat to the query heads."""
    losses: tuple[str, ...] = ()
    """Losses inside the model, reduced over every cp rank's tokens."""
    local_outputs: tuple[str, ...] = ()
    """Outputs left as the rank's tokens (``context_parallel_local_outputs``)."""

    def text(self) -> str:
        """The coverage report (module docstring)."""
        head = (f"context parallelism at degree {self.degree}: {len(self.split)} input"
                f"{'s' * (len(self.split) != 1)} split, {len(self.attention)} attention"
                f"{'s' * (len(self.attention) != 1)} gathering keys and values")
        rows = [("split inputs", self.split), ("attention", self.attention),
                ("whole values cut to local rows", self.localized),
                ("outputs gathered", self.gathered),
                ("grouped-query keys/values gathered before their repeat", self.small_kv),
                ("losses reduced over cp", self.losses),
                ("outputs left local", self.local_outputs)]
        return "\n".join([head] + [f"  {k}: {', '.join(v)}" for k, v in rows if v])

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ContextParallelPlan:
        data = json.loads(text)
        return cls(data["degree"], *(tuple(data[k]) for k in
                                     ("split", "attention", "localized", "gathered",
                                      "small_kv", "losses", "local_outputs")))


__all__ = ["ContextParallelPlan"]
