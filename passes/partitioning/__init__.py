"""Partitioning algorithms on numbers, separate from the passes that apply them.

``problem`` (the DagProblem and the one objective), ``chain`` (exact min-max chain
solver), ``order`` (topological orders), ``refine`` (boundary moves), ``baselines``
(reference partitioners), ``extract`` (fx graph <-> DagProblem), ``synthetic`` (seeded
test and benchmark problems). ``passes.auto_partition`` puts them together.
"""
