"""Small annotated fx graphs for partitioning tests, standing in for the front end.

``annotate`` sets ``MODULE_PATH``, ``PARAMS``, ``TENSOR`` and ``COST`` the way
``passes.trace`` / ``shape_prop`` / ``annotate_costs`` will, with a crude but deterministic
cost: time proportional to output elements and parameter elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from cost_model.node_cost import NodeCost
from passes import meta


@dataclass(frozen=True)
class Info:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def annotate(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*args)
    seen: set[str] = set()
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        nbytes = 0
        if tm is not None and hasattr(tm, "shape"):
            nbytes = int(torch.Size(tm.shape).numel() * tm.dtype.itemsize)
            meta.TENSOR.set(n, Info(tuple(tm.shape), tm.dtype, nbytes))
        stack = n.meta.get("nn_module_stack") or {}
        path = str(n.target) if n.op == "call_module" else (
            list(stack.values())[-1][0] if stack else "")
        meta.MODULE_PATH.set(n, path)
        params: tuple[str, ...] = ()
        if n.op == "call_module":
            sub = gm.get_submodule(str(n.target))
            params = tuple(f"{n.target}.{p}" for p, _ in sub.named_parameters())
        elif n.op == "get_attr":
            params = (str(n.target),)
        meta.PARAMS.set(n, params)
        if n.op in ("call_module", "call_function", "call_method"):
            pbytes = 0
            pel = 0
            for p in params:
                t = gm.get_parameter(p)
                pel += t.numel()
                if p not in seen:
                    seen.add(p)
                    pbytes += t.numel() * t.element_size()
            for a in n.all_input_nodes:
                if a.op == "get_attr":
                    pel += gm.get_parameter(str(a.target)).numel()
            t = 1e-9 * (nbytes / 4 + 2 * pel + 1)
            meta.COST.set(n, NodeCost(fwd_time_s=t, bwd_time_s=2 * t, param_bytes=pbytes,
                                      output_bytes=nbytes, saved_bytes=nbytes, op=n.name))
    return gm


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyGPT(nn.Module):
    """Embedding, residual blocks, LM head tied to the embedding (a shared parameter)."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.linear(self.norm(x), self.emb.weight)


class TwoBranch(nn.Module):
    """A DAG: two independent branches joined at the end."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(d, d) for _ in range(3)])
        self.b = nn.Sequential(*[nn.Linear(d, d) for _ in range(3)])
        self.head = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))


def tiny_gpt(layers: int = 4) -> torch.fx.GraphModule:
    return annotate(TinyGPT(layers=layers), torch.zeros(2, 8, dtype=torch.long))


def two_branch() -> torch.fx.GraphModule:
    return annotate(TwoBranch(), torch.zeros(4, 16))
