"""Which linears and embeddings of a marked region are sharded, in which role, and why the
rest are not.

What cannot be sharded is decided per linear or embedding, never per region, so one odd
op does not leave a whole model replicated; each retry of the sweep turns at least one
column linear lone, so the analysis ends. See docs/tensor_parallel.md, 'The rewrite'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from passes import meta
from passes.tensor_parallel import graph, vocab
from passes.tensor_parallel.linears import Linear, as_linear
from passes.tensor_parallel.propagation import Rewrites, Split
from passes.tensor_parallel.sweep import origins, sweep, where


def in_region(path: str, region: str) -> bool:
    return region == "" or path == region or path.startswith(region + ".")


def region_test(region: tuple[str, ...]) -> Callable[[torch.fx.Node], bool]:
    def inside(n: torch.fx.Node) -> bool:
        return any(in_region(meta.MODULE_PATH.get(n, ""), r) for r in region)
    return inside


def regions(marked: Sequence[str]) -> list[tuple[str, ...]]:
    """The outermost marked paths, siblings grouped (modules created together inside one
    ``smp.tensor_parallelism`` context form one region)."""
    outer = sorted({r for r in marked if not any(r != o and in_region(r, o) for o in marked)})
    groups: dict[str, list[str]] = {}
    for path in outer:
        groups.setdefault(path.rpartition(".")[0] if path else "\0", []).append(path)
    return [tuple(g) for _, g in sorted(groups.items())]


def tied_regions(gm: torch.fx.GraphModule, groups: Sequence[tuple[str, ...]]
                 ) -> list[tuple[str, ...]]:
    """``groups`` with the regions that hold one tensor merged: a tied LM head and its
    embedding marked apart (HF GPT-2's ``lm_head`` and ``transformer.wte`` are not
    siblings) share one shard, so they are sharded together or not at all."""
    params = list(gm.named_parameters(remove_duplicate=False))
    out: list[tuple[tuple[str, ...], set[int]]] = []
    for region in groups:
        ids = {id(p) for name, p in params
               if any(in_region(name.rpartition(".")[0], r) for r in region)}
        for i in [i for i, (_, held) in enumerate(out) if held & ids][::-1]:
            merged, held = out.pop(i)
            region, ids = tuple(sorted({*merged, *region})), ids | held
        out.append((region, ids))
    return [region for region, _ in out]


@dataclass
class Analysis:
    """A region's verdict: the linears sharded (with roles) and embeddings split by rows,
    the nodes carrying a split value (name -> dim), the argument edits, and
    (module, reason) for each linear or embedding left whole or made lone."""

    linears: list[Linear] = field(default_factory=list)
    embeds: list[vocab.Embedding] = field(default_factory=list)
    split: dict[str, int] = field(default_factory=dict)
    rw: Rewrites = field(default_factory=Rewrites)
    replicated: list[tuple[str, str]] = field(default_factory=list)
    lone: list[tuple[str, str]] = field(default_factory=list)


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _embedding_module(emb: vocab.Embedding) -> str:
    """The embedding's module: where its lookup is (torch.export may read a tied table
    under the LM head's name)."""
    return meta.MODULE_PATH.get(emb.node, "") or _module(emb.weight)


def analyse(gm: torch.fx.GraphModule, region: tuple[str, ...], size: int,
            prescaled: bool = True) -> Analysis:
    """The region's verdict (module docstring)."""
    inside = region_test(region)
    out = Analysis()
    linears = {n: lin for n in gm.graph.nodes if inside(n) and (lin := as_linear(gm, n))}
    embeds = []
    for emb in vocab.find(gm, inside):
        why = vocab.reason(emb, size)
        if why is None:
            embeds.append(emb)
        else:
            out.replicated.append((_embedding_module(emb), f"{why} ({where(emb.node)})"))
    if not linears and not embeds:
        if not out.replicated:
            out.replicated.append((",".join(region), "no linear layer or embedding to shard"))
        return out
    lone: set[torch.fx.Node] = set()
    while True:
        _drop_foreign_readers(gm, linears, embeds, out.replicated)
        split, rw, failure = sweep(gm, linears, lone, size)
        if failure is not None:
            for c in failure.culprits:
                lone.add(c)
                out.lone.append((_module(linears[c].weight), failure.reason))
            continue
        if not _checks(linears, embeds, split, rw, size, prescaled, lone, out):
            break
    out.linears, out.embeds, out.rw = list(linears.values()), embeds, rw
    out.split = {n.name: d.dim for n, d in split.items() if n not in linears}
    lone_now = {_module(lin.weight) for lin in linears.values() if lin.role == "lone"}
    out.lone = list(dict.fromkeys((m, why) for m, why in out.lone if m in lone_now))
    return out


def _checks(linears: dict[torch.fx.Node, Linear], embeds: Sequence[vocab.Embedding],
            split: dict[torch.fx.Node, Split], rw: Rewrites, size: int, prescaled: bool,
            lone: set[torch.fx.Node], out: Analysis) -> bool:
    """The checks that need the roles (module docstring); True when one changed a role
    (lone) or dropped a linear (replicated), so the sweep must run again."""
    by_name = {n.name: n for n in linears}
    more: dict[torch.fx.Node, str] = {}  # -> lone, with why
    if rw.batch_reads and not prescaled:
        read = rw.batch_reads[0]
        value = read.args[0]
        assert isinstance(value, torch.fx.Node)
        why = (f"{where(read)} reads the batch size of a split value at run time, which "
               "prescaled_batch false gathers (trace with torch.export, or set "
               "prescaled_batch true)")
        more.update(dict.fromkeys(origins(split, [value], by_name), why))
    if rw.merged and not prescaled:
        merged = rw.merged[0]
        source = merged.args[0]
        assert isinstance(source, torch.fx.Node)
        more.update(dict.fromkeys(origins(split, [source], by_name), (
            f"{where(merged)} merges the batch with a split dim, which prescaled_batch "
            "false (each rank's examples gathered) does not build")))
    rows_split = {id(e.value) for e in embeds}
    drop: dict[torch.fx.Node, str] = {}
    if not prescaled:
        drop.update({n: f"{lin.weight} is a grouped (expert) matmul whose row groups are "
                        "this rank's own tokens, sorted by its routing; prescaled_batch "
                        "false gives each tp rank other tokens, which a gather would mix "
                        f"across the groups ({where(n)}; set prescaled_batch true to shard "
                        "the experts)"
                     for n, lin in linears.items() if lin.kind == "grouped"})
    for n, lin in linears.items():
        if id(lin.weight_value) in rows_split:
            if lin.role == "row":
                more.update(dict.fromkeys(origins(split, [lin.x], by_name), (
                    f"{lin.weight} is tied to a vocab-parallel embedding, which cannot be "
                    "split by columns (row-parallel)")))
            elif lin.role == "col" and vocab.padding(lin.out_features, size):
                more[n] = (f"{lin.weight} is tied to a padded vocab-parallel embedding: its "
                           "padding columns cannot feed a row-parallel linear")
            continue  # split by the embedding's (padded) rows
        dim_size = lin.in_features if lin.role == "row" else lin.out_features
        parts = size * rw.strided.get(n.name, 1)
        if dim_size % parts:
            why = (f"{lin.weight} has {dim_size} {'in' if lin.role == 'row' else 'out'}"
                   f" features, not divisible by tensor_parallel_degree {size}"
                   + (f" x {parts // size} fused blocks" if parts != size else "")
                   + f" ({where(n)})")
            if lin.role == "row":  # fed whole instead, it may shard as a column
                more.update(dict.fromkeys(origins(split, [lin.x], by_name), why))
            else:
                drop[n] = why
    for group in _calls_of_one_weight(linears):
        kinds = {(linears[n].role, rw.strided.get(n.name, 1)) for n in group}
        if len(kinds) > 1:
            why = (f"{linears[group[0]].weight} is called {len(group)} times in different "
                   "roles; all calls are made lone")
            for n in group:
                if linears[n].role == "row":
                    more.update(dict.fromkeys(origins(split, [linears[n].x], by_name), why))
                elif linears[n].role == "col":
                    more[n] = why
    for n, why in drop.items():
        out.replicated.append((_module(linears[n].weight), why))
        del linears[n]
    fresh = {n: why for n, why in more.items() if n in linears and n not in lone}
    for n, why in fresh.items():
        lone.add(n)
        out.lone.append((_module(linears[n].weight), why))
    return bool(drop or fresh)


def _calls_of_one_weight(linears: dict[torch.fx.Node, Linear]) -> list[list[torch.fx.Node]]:
    """Linear nodes sharing one weight, in groups of two or more (a layer applied at
    several depths, ALBERT's; DeBERTa's projections of the relative embeddings)."""
    groups: dict[int, list[torch.fx.Node]] = {}
    for n, lin in linears.items():
        groups.setdefault(id(lin.weight_value), []).append(n)
    return [g for g in groups.values() if len(g) > 1]


def _drop_foreign_readers(gm: torch.fx.GraphModule, linears: dict[torch.fx.Node, Linear],
                          embeds: list[vocab.Embedding],
                          replicated: list[tuple[str, str]]) -> None:
    """Leave whole every linear and embedding whose tensor a node outside the rewrite also
    reads (an unmarked tied module, the weight read by another op): sharding would untie
    them. Repeated until none is left, as each one dropped is such a reader itself."""
    while True:
        owners: dict[int, list[Linear | vocab.Embedding]] = {}
        for lin in linears.values():
            for t in (lin.weight_value, lin.bias_value):
                if t is not None:
                    owners.setdefault(id(t), []).append(lin)
        for e in embeds:
            owners.setdefault(id(e.value), []).append(e)
        rewritten = set(linears) | {e.node for e in embeds} | {
            v for lin in linears.values() for v in lin.views}
        found = _foreign_reader(gm, rewritten, owners)
        if found is None:
            return
        tid, reader, name = found
        for owner in owners[tid]:
            module = _embedding_module(owner) if isinstance(owner, vocab.Embedding) else \
                _module(owner.weight)
            replicated.append((module, (
                f"{owner.weight} is also read by {where(reader)} (as {name}), which the "
                "rewrite does not replace: sharding would untie them")))
            if isinstance(owner, vocab.Embedding):
                embeds.remove(owner)
            else:
                del linears[owner.node]


def _foreign_reader(gm: torch.fx.GraphModule, rewritten: set[torch.fx.Node],
                    owners: dict[int, list[Linear | vocab.Embedding]]
                    ) -> tuple[int, torch.fx.Node, str] | None:
    for n in gm.graph.nodes:
        if n in rewritten or (n.op == "get_attr" and all(u in rewritten for u in n.users)):
            continue  # a rewritten node itself, or a get_attr feeding only those (or none)
        for name in meta.PARAMS.get(n, ()) or ():
            try:
                t = graph.attr(gm, name)
            except AttributeError:
                continue
            if id(t) in owners:
                return id(t), n, name
    return None


def pairs(linears: Sequence[Linear], split: set[str]) -> list[tuple[str, str]]:
    """(column, row) module paths: each row linear with the column linears whose output
    reaches it through the element-wise chain between them."""
    cols = [lin for lin in linears if lin.role == "col"]  # graph order
    out = []
    for row in (lin for lin in linears if lin.role == "row"):
        seen: set[str] = set()
        todo = list(row.node.all_input_nodes)
        while todo:
            n = todo.pop()
            if n.name not in seen:
                seen.add(n.name)
                if n.name in split:
                    todo.extend(n.all_input_nodes)
        out += [(_module(c.weight), _module(row.weight)) for c in cols if c.node.name in seen]
    return out


__all__ = ["Analysis", "analyse", "in_region", "pairs", "region_test", "regions",
           "tied_regions"]
