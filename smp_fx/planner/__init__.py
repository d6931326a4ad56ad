"""The cluster planner behind ``smp-fx plan`` (docs/planning.md): ``planner.plan`` is the entry."""
