"""Expert parallelism on the module tree: each MoE block's experts replaced by their slice.

Why module-level, not a rewrite of the traced graph: Hugging Face's experts are already one
module with one entry, ``experts(hidden, top_k_index, top_k_weights)``, called by the
block after its router. Replacing that module before tracing keeps the router, the shared
experts and the router logits the model returns exactly as they were (one process's code),
and the slice's parameters keep their names, so the graph, the plan and checkpoints see
``...experts.gate_up_proj`` with E / ep experts. The dispatch is one opaque op
(``smp_fx.parallel.ep_dispatch``) that torch.export traces as a node.

Found by structure: a module whose 3-D parameters ``gate_up_proj`` (E, 2 I, H) and
``down_proj`` (E, H, I) have E experts and no biases (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V2/V3, ...). A module that looks like experts in another layout (transposed,
with biases, a list of expert modules) stays replicated and the coverage says why.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from smp_fx.expert_ranks import check_experts_divide, expert_slice
from smp_fx.marking.delayed_init import DELAYED_ATTR, TAPE_ATTR, extending
from smp_fx.parallel.ep_dispatch import ACTIVATIONS, ep_experts
from smp_fx.world import state

log = logging.getLogger("smp_fx.parallel.ep_experts")


@dataclass(frozen=True)
class BlockCoverage:
    """One MoE block's experts: expert-parallel (``reason`` empty) or replicated."""

    path: str
    num_experts: int
    local_experts: int
    reason: str = ""

    def line(self) -> str:
        if self.reason:
            return f"{self.path}: replicated ({self.num_experts} experts): {self.reason}"
        return (f"{self.path}: expert-parallel, {self.local_experts} of {self.num_experts} "
                "experts per rank")


class ExpertParallelExperts(nn.Module):
    """A block's experts ``first .. first + local - 1`` of ``num_experts``; the rest live
    on the other ranks of the ep group. Called as the module it replaces."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, num_experts: int,
                 first: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)
        self.num_experts = num_experts
        self.first_expert = first
        self.act = act

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = ep_experts(hidden_states, top_k_index, top_k_weights,
                                       self.gate_up_proj, self.down_proj, self.act,
                                       self.num_experts)
        return out

    def extra_repr(self) -> str:
        local = self.gate_up_proj.shape[0]
        return (f"experts={self.first_expert}..{self.first_expert + local - 1} of "
                f"{self.num_experts}, act={self.act}")


def _looks_like_experts(m: nn.Module) -> bool:
    return type(m).__name__.endswith("Experts") or (
        hasattr(m, "num_experts") and hasattr(m, "down_proj"))


def _refusal(m: nn.Module) -> str:
    """Why ``m`` (that looks like experts) cannot be split, or '' when it can."""
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return "experts not held as fused 3-D gate_up_proj / down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3 or getattr(m, "is_transposed", False):
        return "expert weights not laid out (experts, out, in)"
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} differ"
    if getattr(m, "has_bias", False) or any(n.endswith("bias") for n, _ in
                                           m.named_parameters(recurse=False)):
        return "experts with biases"
    if activation_name(getattr(m, "act_fn", None)) is None:
        return f"activation {type(getattr(m, 'act_fn', None)).__name__} not one of " \
            f"{', '.join(ACTIVATIONS)}"
    return ""


def activation_name(act: object) -> str | None:
    """The name in ``ACTIVATIONS`` of the function ``act`` computes (matched by value)."""
    if not callable(act):
        return None
    x = torch.linspace(-4.0, 4.0, 257)
    for name, fn in ACTIVATIONS.items():
        try:
            if torch.allclose(act(x), fn(x), rtol=0.0, atol=1e-6):
                return name
        except (TypeError, RuntimeError):
            return None
    return None


def replace_experts(model: nn.Module, ep: int, ep_rank: int, st: state.State | None
                    ) -> list[BlockCoverage]:
    """Replace, in place, every experts module of ``model`` by ``ExpertParallelExperts``
    holding ep rank ``ep_rank``'s slice; returns a coverage line's data per block (also
    logged). Weights are taken as rdp rank 0 of ``st`` has them (collective over the rdp
    group); ``st`` None: before ``smp.init``, nothing to take."""
    found: list[BlockCoverage] = []
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not _looks_like_experts(child) or isinstance(child, ExpertParallelExperts):
                continue
            where = f"{path}.{name}" if path else name
            reason = _refusal(child)
            num = int(getattr(child, "num_experts", 0) or 0)
            if reason:
                found.append(BlockCoverage(where, num, num, reason))
                continue
            gate_up, down = child.gate_up_proj, child.down_proj
            num = gate_up.shape[0]
            check_experts_divide(ep, num, where)
            keep = expert_slice(num, ep, ep_rank)
            delayed = gate_up.is_meta or down.is_meta
            if st is not None and not delayed:  # delayed: each rank replays the same values
                _same_as_rdp_root(st, gate_up, down)
            with extending(child) if delayed else nullcontext():  # materialised: the rows
                new = ExpertParallelExperts(
                    gate_up.detach()[keep.start:keep.stop].clone(),
                    down.detach()[keep.start:keep.stop].clone(), num, keep.start,
                    activation_name(child.act_fn) or "")
            if delayed:  # the record outlives the replaced module
                object.__setattr__(new, TAPE_ATTR, getattr(child, TAPE_ATTR, None))
                object.__setattr__(new, DELAYED_ATTR, True)
            new.gate_up_proj.requires_grad_(gate_up.requires_grad)
            new.down_proj.requires_grad_(down.requires_grad)
            new.train(child.training)
            setattr(parent, name, new)
            found.append(BlockCoverage(where, num, len(keep)))
    for block in found:
        log.info("smp-fx expert parallelism (ep %d): %s", ep, block.line())
    if not found:
        log.info("smp-fx expert parallelism (ep %d): the model has no MoE experts module; "
                 "every parameter is replicated", ep)
    return found


def _same_as_rdp_root(st: state.State, *weights: torch.Tensor) -> None:
    """The full weights as rdp rank 0 holds them (data parallelism's broadcast, made here
    because expert slices are cut before that broadcast and not reduced with it)."""
    if st.in_process or st.axis_size("rdp") == 1:
        return
    root = st.group_ranks("rdp")[0]
    for w in weights:  # still where the script built them: the object group's (gloo) for CPU
        group = st.object_group("rdp") if w.device.type == "cpu" else st.process_group("rdp")
        dist.broadcast(w.data, src=root, group=group)


def split_experts(model: nn.Module, st: state.State | None) -> list[BlockCoverage]:
    """``replace_experts`` at this rank's ep degree and rank (nothing at degree 1)."""
    from smp_fx.world import expert_groups

    if st is None or expert_groups.ep_size() == 1:
        return []
    return replace_experts(model, expert_groups.ep_size(), expert_groups.ep_rank(), st)
