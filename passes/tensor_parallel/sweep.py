"""One sweep of sharding propagation for ``passes.tensor_parallel``: the roles of a
region's linears (column, row, lone) and the split each value of the graph gets from the
rules of ``passes.tensor_parallel.rules``.

A sweep stops at the first op no rule covers and names the column linear behind it; the
caller retries that linear as a lone one (its output gathered) and sweeps again, until the
region shards or is left replicated with the reason.
"""

from __future__ import annotations

import torch
import torch.fx

from passes.tensor_parallel import loss
from passes.tensor_parallel.linears import Linear
from passes.tensor_parallel.propagation import (
    Rewrites,
    Split,
    Unsupported,
    arg,
    norm_dim,
    shape,
    size_read,
)
from passes.tensor_parallel.rules import rule


def sweep(gm: torch.fx.GraphModule, linears: dict[torch.fx.Node, Linear],
          lone: set[torch.fx.Node], size: int
          ) -> tuple[dict[torch.fx.Node, Split], Rewrites, str | None, torch.fx.Node | None]:
    """One sweep of sharding propagation over the graph, setting each linear's role: the
    split values, the edits, the first failure and the column linear to retry as a lone one
    (the failure is at its output or a float cast of it, or an op no rule covers reads a
    value of it alone)."""
    split: dict[torch.fx.Node, Split] = {}
    rw = Rewrites()
    by_name = {n.name: n for n in linears}
    for n in gm.graph.nodes:
        lin = linears.get(n)
        if lin is not None:
            x = lin.x
            if x in split:
                rank = len(shape(x) or ())
                if split[x].dim not in (-1, rank - 1):
                    return split, rw, (f"{lin.weight} reads {x.name} split along dim "
                                       f"{split[x].dim}, not its features"), None
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
            continue
        if size_read(n):  # the local tensor's sizes, read at run time: already local
            if norm_dim(arg(n, 1, "dim", 0), len(shape(n.args[0]) or (0,))) == 0:
                rw.batch_reads.append(n)
            continue
        culprit = next((c for a in ins if (c := loss.uncast(a)) in linears), None)
        try:
            out_split = rule(gm, n, split, rw, size, by_name.get)
        except Unsupported as exc:
            return split, rw, str(exc), culprit
        if out_split is None:  # the culprit behind views, casts (HF: logits.float())
            return split, rw, (f"the split value {ins[0].name} reaches {n.name} ({n.target}), "
                               "which no sharding rule covers"),\
                culprit or by_name.get(split[ins[0]].origin)
        split[n] = out_split
    return split, rw, None, None


__all__ = ["sweep"]
