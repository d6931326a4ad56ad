"""Partitioning algorithms on numbers, separate from the passes that apply them.

``problem`` (the DagProblem, its networkx graph, and the one objective), ``chain`` (exact
min-max chain solver, numpy), ``order`` (topological orders and DAG/pin checks, networkx),
``refine`` (boundary moves), ``mincut`` (minimum-cut boundary moves, networkx),
``baselines`` (reference partitioners), ``extract`` (fx graph <-> DagProblem),
``synthetic`` (seeded test and benchmark problems). ``passes.auto_partition`` puts them
together.
"""
