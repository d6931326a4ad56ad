"""From an annotated fx GraphModule to a ``DagProblem``, and stage numbers back onto nodes.

Only compute nodes carry cost; placeholders and ``get_attr`` nodes follow their earliest
user and are replicated, never sent. Parameters are counted per tensor, so tied names are
one parameter, as in the plan. See docs/architecture.md, 'Stage assignment and splitting'.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.fx

from cost_model.errors import SMPPartitionError
from passes import meta
from passes.graph_utils import copy_graph_module, tensor_at
from passes.partitioning.problem import DagProblem

COMPUTE_OPS = ("call_function", "call_method", "call_module")


class _TensorIndex:
    """Attribute names grouped by the tensor they name, keyed by the name
    ``named_parameters()`` reports, so a tied weight is charged once."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.key_of_id: dict[int, str] = {}
        self.names: dict[str, list[str]] = {}
        self.key_of_name: dict[str, str] = {}
        self.nbytes: dict[str, float] = {}
        self._keep: list[torch.Tensor] = []  # ids stay unique while the tensors live
        named = [*gm.named_parameters(remove_duplicate=False),
                 *gm.named_buffers(remove_duplicate=False)]
        for name, t in named:
            self._add(name, t)

    def _add(self, name: str, t: torch.Tensor) -> str:
        key = self.key_of_id.get(id(t))
        if key is None:
            key = self.key_of_id[id(t)] = name
            self.names[key] = []
            self.nbytes[key] = float(t.numel() * t.element_size())
            self._keep.append(t)
        if name not in self.key_of_name:
            self.key_of_name[name] = key
            self.names[key].append(name)
        return key

    def key(self, name: str) -> str | None:
        """The key of the tensor ``name`` resolves to, or None if it names no tensor."""
        if name in self.key_of_name:
            return self.key_of_name[name]
        t = tensor_at(self.gm, name)
        return None if t is None else self._add(name, t)


def _flops(node: torch.fx.Node) -> float:
    cost = meta.COST.get(node)
    return 0.0 if cost is None else float(cost.fwd_flops + cost.bwd_flops)


def _value_bytes(node: torch.fx.Node) -> float:
    cost = meta.COST.get(node)
    if cost is not None:
        return float(cost.output_bytes)
    info = meta.TENSOR.get(node)
    infos = info if isinstance(info, tuple) else (info,)
    return float(sum(getattr(i, "nbytes", 0) or 0 for i in infos))


def problem_from_graph(gm: torch.fx.GraphModule) -> DagProblem:
    """Reduce ``gm`` (with ``COST`` on every compute node) to a ``DagProblem``."""
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    index = {n: i for i, n in enumerate(nodes)}
    time, saved = np.zeros(len(nodes)), np.zeros(len(nodes))
    for i, n in enumerate(nodes):
        cost = meta.COST.get(n)
        if cost is None:
            raise SMPPartitionError.build(
                "every compute node needs a cost (passes.meta.COST)", None,
                f"node={n.format_node()}", "run passes.annotate_costs before partitioning")
        time[i], saved[i] = cost.fwd_time_s + cost.bwd_time_s, cost.saved_bytes
    preds = tuple(tuple(sorted({index[a] for a in n.all_input_nodes if a in index}))
                  for n in nodes)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out_inputs = tuple(sorted({index[a] for a in output.all_input_nodes if a in index}))
    producers, vbytes, consumers, to_out = [], [], [], []
    for n in gm.graph.nodes:
        if n.op not in (*COMPUTE_OPS, "placeholder"):
            continue
        cons = tuple(sorted({index[u] for u in n.users if u in index}))
        reaches_out = output in n.users
        if not cons and not reaches_out:
            continue
        producers.append(index.get(n, -1))
        vbytes.append(_value_bytes(n))
        consumers.append(cons)
        to_out.append(reaches_out)
    tensors = _TensorIndex(gm)
    readers: dict[str, set[int]] = {}
    sizes: dict[str, float] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            names = meta.PARAMS.get(n) or (str(n.target),)
            users = [index[u] for u in n.users if u in index]
        elif n in index:
            names = meta.PARAMS.get(n) or ()
            users = [index[n]]
        else:
            continue
        keys = {k for k in map(tensors.key, names) if k is not None}
        for key in keys:
            sizes[key] = tensors.nbytes[key]
            readers.setdefault(key, set()).update(users)
        if n in index and not keys:
            own = float(meta.COST.get(n).param_bytes)
            if own > 0:
                sizes[f"{n.name}:params"] = own
                readers[f"{n.name}:params"] = {index[n]}
    pnames = tuple(sorted(name for name in readers if readers[name]))
    aliases = tuple(tuple(tensors.names.get(p, [p])) for p in pnames)
    paths = tuple(meta.MODULE_PATH.get(n) or (str(n.target) if n.op == "call_module" else "")
                  for n in nodes)
    pins = tuple(int(meta.PIN.get(n, -1)) for n in nodes)
    return DagProblem(
        names=tuple(n.name for n in nodes), time=time, saved=saved, preds=preds,
        val_producer=tuple(producers), val_bytes=np.asarray(vbytes, dtype=np.float64),
        val_consumers=tuple(consumers), val_to_output=tuple(to_out),
        output_inputs=out_inputs, param_names=pnames,
        param_bytes=np.asarray([sizes[p] for p in pnames], dtype=np.float64),
        param_readers=tuple(tuple(sorted(readers[p])) for p in pnames), param_aliases=aliases,
        module_paths=paths, pins=pins,
        flops=np.asarray([_flops(n) for n in nodes], dtype=np.float64))


def write_stages(gm: torch.fx.GraphModule, stages: Mapping[str, int]
                 ) -> torch.fx.GraphModule:
    """Copy ``gm`` and set ``STAGE`` on every node: compute nodes from ``stages`` (by name),
    placeholders / ``get_attr`` at their earliest user, the output at its latest input."""
    missing = [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS and n.name not in stages]
    if missing:
        raise SMPPartitionError.build("every compute node needs a stage", missing[:5],
                                      "write_stages", "pass a stage for every compute node")
    new = copy_graph_module(gm)
    nodes = list(new.graph.nodes)
    for n in nodes:
        if n.op in COMPUTE_OPS:
            meta.STAGE.set(n, int(stages[n.name]))
    last = max(stages.values(), default=0)
    for n in reversed(nodes):
        if n.op in ("placeholder", "get_attr"):
            used = [meta.STAGE.get(u) for u in n.users if meta.STAGE.has(u)]
            meta.STAGE.set(n, int(min(used, default=0)))
    for n in nodes:
        if n.op == "output":
            ins = [meta.STAGE.get(a) for a in n.all_input_nodes if a.op in COMPUTE_OPS]
            meta.STAGE.set(n, int(max(ins, default=last)))
    return new
