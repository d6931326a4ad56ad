"""Partitioning algorithms on numbers, separate from the passes that apply them.

See docs/partitioning.md, 'The solver in detail'; ``passes.auto_partition`` puts them
together.
"""
