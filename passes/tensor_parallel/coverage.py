"""How much of a model tensor parallelism shards, and why the rest is not: the report
``smp-fx partition --tensor-parallel-degree N`` prints and ``tp_coverage()`` returns.

>>> from passes.tensor_parallel.plan import TensorParallelPlan
>>> plan = TensorParallelPlan(2, elements=(900, 1000),
...                           replicated=(("embed", "an option is set"),))
>>> print(coverage(plan).text())
tensor parallelism at degree 2: 90.0% of 1,000 parameter elements sharded
  0 column -> row pairs, 0 lone linears, 1 linear or embedding replicated
  replicated embed: an option is set
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from passes.tensor_parallel.plan import TensorParallelPlan


@dataclass(frozen=True)
class Coverage:
    """The coverage of one plan (module docstring)."""

    degree: int
    sharded_elements: int
    total_elements: int
    pairs: int
    replicated: tuple[tuple[str, str], ...]
    lone: tuple[tuple[str, str], ...]

    @property
    def share(self) -> float:
        return self.sharded_elements / self.total_elements if self.total_elements else 0.0

    def text(self, lone: bool = False) -> str:
        """The report: the share, the counts, each replicated module with its reason (and
        with ``lone``, each lone linear with its reason)."""
        lines = [f"tensor parallelism at degree {self.degree}: {self.share:.1%} of "
                 f"{self.total_elements:,} parameter elements sharded",
                 f"  {self.pairs} column -> row pairs, {len(self.lone)} lone linears, "
                 f"{len(self.replicated)} linear or embedding replicated"]
        lines += [f"  replicated {m}: {why}" for m, why in self.replicated]
        lines += [f"  lone {m}: {why}" for m, why in self.lone] if lone else []
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"degree": self.degree, "sharded_elements": self.sharded_elements,
                "total_elements": self.total_elements, "share": self.share,
                "pairs": self.pairs, "replicated": [list(r) for r in self.replicated],
                "lone": [list(r) for r in self.lone]}


def coverage(plan: TensorParallelPlan) -> Coverage:
    """The coverage report of ``plan``."""
    done, total = plan.elements
    return Coverage(plan.size, done, total, len(plan.pairs), plan.replicated, plan.lone)


__all__ = ["Coverage", "coverage"]
