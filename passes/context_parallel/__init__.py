"""Context parallelism as a graph pass: the sequence split over ranks, attention whole.

``rewrite`` finds what to split on the traced graph (``dims``: where the sequence is)
and refuses what it cannot split (``refusals``); ``collectives`` holds the ops the
rewritten graph calls (split, gather, local rows); ``attention`` the attention over
gathered keys and values (``gqa``: gathered before a grouped-query repeat); ``coverage``
the plan and its report. docs/context_parallel.md says how it works and what it refuses.
"""

from passes.context_parallel.coverage import ContextParallelPlan
from passes.context_parallel.rewrite import context_parallel

__all__ = ["ContextParallelPlan", "context_parallel"]
