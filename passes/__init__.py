"""Graph passes over torch.fx GraphModules: trace, shape_prop, annotate_costs, partition, split."""

from __future__ import annotations
