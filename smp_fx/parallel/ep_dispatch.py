"""Expert-parallel MoE experts: tokens to their experts' ranks by all-to-all, and back.

One rank of an ep group of P holds E / P of a block's E experts (``gate_up`` is
``(E / P, 2 I, H)``, ``down`` is ``(E / P, H, I)``, Hugging Face's fused 3-D layout).
``route`` sends every (token, slot) of the router's top-k to the rank holding its expert
(dropless: per-expert counts are exchanged first, then the rows with variable splits),
runs each local expert on the rows it got, sends the results back and adds them up in
the tokens' order with the router's weights, as the one-process loop does.

In the traced graph all of this is one opaque op, ``torch.ops.smp_fx.ep_experts`` (its
shapes: output like ``hidden``), so torch.export and shape propagation never see the
data-dependent splits. Its backward recomputes ``route`` with autograd on (one dispatch
and one combine all-to-all more, like activation checkpointing of the experts) and
differentiates it: an all-to-all's gradient is the all-to-all back (``_AllToAll``).

``counting()`` measures what the op moves (benchmarks/expert_parallel.py): rows and bytes
each rank sends to the others, and rows per local expert.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp_fx.world import expert_groups

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""The experts' activations the op runs, by name (``ep_experts.activation_name``)."""


@dataclass
class Traffic:
    """What the op moved on this rank while ``counting``: rows and bytes sent to other
    ranks by every all-to-all of rows (dispatch, combine, their gradients, the backward's
    recomputation), and rows each local expert ran on (recomputation included)."""

    rows_sent: int = 0
    bytes_sent: int = 0
    rows_per_expert: list[int] = field(default_factory=list)

    def add_expert_rows(self, counts: list[int]) -> None:
        if len(self.rows_per_expert) < len(counts):
            self.rows_per_expert += [0] * (len(counts) - len(self.rows_per_expert))
        for i, c in enumerate(counts):
            self.rows_per_expert[i] += c


_COUNTING: list[Traffic] = []
_LOCK = threading.Lock()  # microbatch threads run the op concurrently


@contextmanager
def counting() -> Iterator[Traffic]:
    """Count the op's traffic on this rank inside the block."""
    traffic = Traffic()
    _COUNTING.append(traffic)
    try:
        yield traffic
    finally:
        _COUNTING.remove(traffic)


def _count(rows: int = 0, nbytes: int = 0, experts: list[int] | None = None) -> None:
    with _LOCK:
        for t in _COUNTING:
            t.rows_sent += rows
            t.bytes_sent += nbytes
            if experts is not None:
                t.add_expert_rows(experts)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[j]`` of ``x`` to rank j of ``group``; ``recv[j]`` rows from it."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    if _COUNTING:
        away = sum(send) - send[dist.get_rank(group)]
        _count(away, away * x[:1].numel() * x.element_size())
    return out


def _local_experts(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                   down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """Rows of ``x`` grouped by local expert (``counts`` each) through their experts."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_empty((0, down.shape[1]))


def route(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
          gate_up: torch.Tensor, down: torch.Tensor, act: str, num_experts: int,
          group: Any, ep: int) -> torch.Tensor:
    """The experts' output for ``hidden`` (T, H): see the module docstring. Differentiable
    (the all-to-alls through ``_AllToAll``). Every rank of ``group`` must call it."""
    local = num_experts // ep
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)  # an index outside adds nothing, as in HF
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
    order = order[:int(valid.sum())]
    experts = flat[order]
    token = order // k
    weight = top_k_weights.reshape(-1)[order]
    counts = torch.bincount(experts, minlength=num_experts)  # rows per global expert
    send = counts.view(ep, local).sum(1).tolist()
    if ep > 1:
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)  # (source, local expert) counts
    else:
        got = counts
    got = got.view(ep, local)
    recv = got.sum(1).tolist()
    rows = hidden[token]
    if ep > 1:
        rows = _AllToAll.apply(rows, send, recv, group)
    # rows arrive by source rank, each source's by expert: regroup by local expert
    expert_of_row = torch.repeat_interleave(
        torch.arange(local, device=got.device).repeat(ep), got.reshape(-1))
    perm = torch.argsort(expert_of_row, stable=True)
    per_expert = got.sum(0).tolist()
    if _COUNTING:
        _count(experts=per_expert)
    done = _local_experts(rows[perm], per_expert, gate_up, down, ACTIVATIONS[act])
    back = torch.empty_like(done).index_copy(0, perm, done)
    if ep > 1:
        back = _AllToAll.apply(back, recv, send, group)
    contrib = (back * weight[:, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, token, contrib)


def _group() -> tuple[Any, int]:
    return expert_groups.get_ep_process_group(), expert_groups.ep_size()


@torch.library.custom_op("smp_fx::ep_experts", mutates_args=())
def ep_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               gate_up: torch.Tensor, down: torch.Tensor, act: str,
               num_experts: int) -> torch.Tensor:
    """``route`` over this rank's ep group, as one node of the traced graph."""
    group, ep = _group()
    return route(hidden, top_k_index, top_k_weights, gate_up, down, act, num_experts, group,
                 ep)


@ep_experts.register_fake
def _(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
      gate_up: torch.Tensor, down: torch.Tensor, act: str, num_experts: int) -> torch.Tensor:
    return torch.empty_like(hidden)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    hidden, top_k_index, top_k_weights, gate_up, down, act, num_experts = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up, down)
    ctx.act, ctx.num_experts = act, num_experts


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Recompute ``route`` with autograd and differentiate it. Every input gets its
    gradient on every rank, so each rank runs the same all-to-alls."""
    hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    group, ep = _group()
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (hidden, top_k_weights, gate_up,
                                                            down)]
        h, w, gu, dn = leaves
        out = route(h, top_k_index, w, gu, dn, ctx.act, ctx.num_experts, group, ep)
        gh, gw, ggu, gdn = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return gh, None, gw, ggu, gdn, None, None


ep_experts.register_autograd(_backward, setup_context=_setup)
