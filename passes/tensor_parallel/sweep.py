"""One sweep of sharding propagation: the roles of a region's linears and the split of each
value; a failed sweep names the column linears behind it for the analysis to retry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from passes import meta
from passes.tensor_parallel import loss
from passes.tensor_parallel.linears import Linear
from passes.tensor_parallel.propagation import (
    Rewrites,
    Split,
    Unsupported,
    arg,
    grad_flow,
    norm_dim,
    shape,
    size_read,
)
from passes.tensor_parallel.rules import rule


@dataclass(frozen=True)
class Failure:
    """Where a split value could not go on: the reason (naming the node and its op) and
    the column linears it came from, to retry as lone ones."""

    reason: str
    node: torch.fx.Node
    culprits: tuple[torch.fx.Node, ...]


def origins(split: dict[torch.fx.Node, Split], values: list[torch.fx.Node],
            by_name: dict[str, torch.fx.Node]) -> tuple[torch.fx.Node, ...]:
    """The column linears the split ``values`` come from (graph order, once each)."""
    names = dict.fromkeys(o for v in values if v in split for o in split[v].origin.split(","))
    return tuple(by_name[o] for o in names if o in by_name)


def where(n: torch.fx.Node) -> str:
    """``n`` as a reason names it: the node, its op and the module it came from."""
    target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
    path = meta.MODULE_PATH.get(n, "") or "the model's root"
    return f"{n.name} ({target}, in {path})"


def sweep(gm: torch.fx.GraphModule, linears: dict[torch.fx.Node, Linear],
          lone: set[torch.fx.Node], size: int
          ) -> tuple[dict[torch.fx.Node, Split], Rewrites, Failure | None]:
    """One sweep of sharding propagation over the graph, setting each linear's role: the
    split values, the edits, and the first failure. Its culprits are the linear feeding
    the failing op directly (through float casts: HF's ``logits.float()``), else the
    column linears the failing op's split inputs come from."""
    split: dict[torch.fx.Node, Split] = {}
    rw = Rewrites(grad=grad_flow(gm))
    by_name = {n.name: n for n in linears}
    for n in gm.graph.nodes:
        lin = linears.get(n)
        if lin is not None:
            x = lin.x
            if x in split:
                rank = len(shape(x) or ())
                if split[x].dim not in (-1, rank - 1):
                    return split, rw, Failure(
                        f"{lin.weight} reads {x.name} split along dim {split[x].dim}, not "
                        "its features", n, origins(split, [x], by_name))
                lin.role = "row"
            elif n in lone:
                lin.role = "lone"
            else:
                lin.role = "col"
                out = shape(n)
                split[n] = Split(-1 if out is None else len(out) - 1, n.name)
            continue
        ins = [a for a in n.all_input_nodes if a in split]
        if not ins:
            if any(a in rw.reduced for a in n.all_input_nodes):
                rw.reduced.add(n)
            continue
        if size_read(n):  # the local tensor's sizes, read at run time: already local
            if norm_dim(arg(n, 1, "dim", 0), len(shape(n.args[0]) or (0,))) == 0:
                rw.batch_reads.append(n)
            continue
        direct = tuple(dict.fromkeys(c for a in ins if (c := loss.uncast(a)) in linears))
        try:
            out_split = rule(gm, n, split, rw, size, by_name.get)
        except Unsupported as exc:
            return split, rw, Failure(f"{exc} at {where(n)}", n,
                                      direct or origins(split, ins, by_name))
        if out_split is None:
            return split, rw, Failure(
                f"the split value {ins[0].name} reaches {where(n)}, which no sharding "
                "rule covers", n, direct or origins(split, ins, by_name))
        if isinstance(out_split, Split):
            split[n] = out_split
        else:
            rw.reduced.add(n)
    return split, rw, None


__all__ = ["Failure", "origins", "sweep", "where"]
