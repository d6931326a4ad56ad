"""A tiny GPT (examples/models/gpt.py) and a cluster whose links are the a100 spec's own, so
the planner's prices can be compared with ``compile_model``'s number for number."""

from __future__ import annotations

from typing import Any

import torch

from cost_model.cluster import ClusterSpec
from cost_model.devices import get_device
from examples.models import gpt


def tiny_gpt(n_layer: int = 4, **kw: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.build_model(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=64, seq_len=16,
                           **kw)


def gpt_inputs(batch: int) -> tuple[torch.Tensor, ...]:
    return gpt.example_inputs(batch, seq_len=16, vocab_size=64)


def link_cluster(gpus_per_node: int = 8, memory_gib: float | None = None) -> ClusterSpec:
    """One a100 node whose NVLink is the spec's link (latency + bytes / bandwidth)."""
    spec = get_device("a100")
    if memory_gib is not None:
        import dataclasses

        spec = dataclasses.replace(spec, memory_bytes=int(memory_gib * 1024**3))
    return ClusterSpec("test", spec, gpus_per_node, spec.link_bandwidth, spec.link_bandwidth,
                       spec.link_latency_s, spec.link_latency_s)
