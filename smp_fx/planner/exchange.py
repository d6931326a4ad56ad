"""What expert and context parallelism hold and exchange, per part of a traced model.

Why here: the planner prices a plan from the graph alone (``smp_fx.planner.profile``), so
the experts and the exchanges are found on it with the runtime's own rules. Experts are the
3-D parameters ``experts.gate_up_proj`` (E, 2 I, H) and ``experts.down_proj`` (E, H, I)
that ``smp_fx.parallel.ep_experts`` splits over the ep group; each router's ``topk`` picks
tokens x k experts, and every pick sends a token's H activations to its expert's rank and
back (an all-to-all each way). Context parallelism gathers each attention's keys and values
(``passes.attention_core``) over the cp group: the bytes of both at the whole sequence.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from passes import meta
from passes.attention_core import CORE_ENDS, attention_cores
from passes.checkpoint_regions import COMPUTE

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def is_expert(name: str, tensor: torch.Tensor) -> bool:
    """Whether parameter ``name`` holds experts ep splits (module docstring)."""
    path = name.split(".")
    return (tensor.dim() == 3 and len(path) >= 2 and path[-2] == "experts"
            and path[-1] in EXPERT_TENSORS)


def expert_ids(gm: torch.nn.Module) -> dict[int, int]:
    """Expert tensors of ``gm``: id -> bytes per token of one pick (H x element size)."""
    found = [(name, t) for name, t in gm.named_parameters(remove_duplicate=False)
             if is_expert(name, t)]
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in found:
        path, _, leaf = name.rpartition(".")
        blocks.setdefault(path, {})[leaf] = t
    out: dict[int, int] = {}
    for name, t in found:
        hidden = hidden_size(blocks[name.rpartition(".")[0]])
        out[id(t)] = hidden * t.element_size()
    return out


def hidden_size(block: dict[str, torch.Tensor]) -> int:
    """H of one MoE block's experts, in either layout transformers uses: Mixtral's
    gate_up (E, 2I, H) and down (E, H, I), or GPT-OSS's transposed (E, H, 2I), (E, I, H).

    >>> hidden_size({"gate_up_proj": torch.empty(4, 6, 3, device="meta"),
    ...              "down_proj": torch.empty(4, 5, 3, device="meta")})
    3
    >>> hidden_size({"gate_up_proj": torch.empty(4, 3, 10, device="meta"),
    ...              "down_proj": torch.empty(4, 5, 3, device="meta")})
    3
    """
    gate_up, down = block.get("gate_up_proj"), block.get("down_proj")
    if gate_up is None or down is None:
        t = gate_up if gate_up is not None else down
        assert t is not None
        return int(t.shape[-1] if gate_up is not None else t.shape[1])
    a, b = int(gate_up.shape[1]), int(gate_up.shape[2])
    c, d = int(down.shape[1]), int(down.shape[2])
    if a == d and b == 2 * c:
        return a  # transposed: (E, H, 2I), (E, I, H)
    return b


def expert_count(gm: torch.nn.Module) -> int:
    """The number of experts every MoE block of ``gm`` can split by (the gcd of their
    expert counts: ep must divide each, ``smp_fx.expert_ranks``); 0 without experts."""
    counts = {int(t.shape[0]) for name, t in gm.named_parameters() if is_expert(name, t)}
    return math.gcd(*counts) if counts else 0


def _numel(node: object) -> int:
    info = meta.TENSOR.get(node) if isinstance(node, torch.fx.Node) else None
    first = info[0] if isinstance(info, tuple) else info
    shape = getattr(first, "shape", None)
    return math.prod(shape) if shape is not None else 0


def _nbytes(node: object) -> int:
    info = meta.TENSOR.get(node) if isinstance(node, torch.fx.Node) else None
    return int(getattr(info, "nbytes", 0) or 0)


def dispatch_bytes(nodes: list[torch.fx.Node], pick_bytes: int) -> int:
    """Bytes one rank sends each way per MoE block's dispatch, summed over the part's
    routers: tokens x k picks of ``pick_bytes`` each (0 without experts)."""
    if not pick_bytes:
        return 0
    picks = sum(_numel(n) for n in nodes if "topk" in str(n.target))
    return picks * pick_bytes


def kv_bytes(nodes: list[torch.fx.Node]) -> int:
    """Bytes of the keys and values every attention core of ``nodes`` reads (the whole
    sequence's, which context parallelism gathers)."""
    total = 0
    for core in attention_cores([n for n in nodes if n.op in COMPUTE]):
        first = core[0]
        if "scaled_dot_product_attention" in str(first.target):
            total += _nbytes(first.args[1]) + _nbytes(first.args[2])
            continue
        ends = [n for n in core if meta_op(n) in CORE_ENDS]
        if len(ends) >= 2:
            total += _nbytes(ends[0].args[1]) + _nbytes(ends[-1].args[1])
    return total


def meta_op(node: torch.fx.Node) -> str:
    """The op name ``passes.annotate_costs`` gave ``node`` ('' when none)."""
    cost = meta.COST.get(node)
    return str(getattr(cost, "op", "") or "")


__all__ = ["EXPERT_TENSORS", "dispatch_bytes", "expert_count", "expert_ids", "hidden_size",
           "is_expert", "kv_bytes", "meta_op"]
