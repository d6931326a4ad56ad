"""Split a stage-annotated GraphModule into one GraphModule per pipeline stage.

The partitioner decides; this module applies the decision and owns the rules (inputs and
parameters replicated, values sent forward only, outputs from the last stage). Stages are
built from the original root, sharing its ``Parameter`` objects and names. See
docs/architecture.md, 'Stage assignment and splitting'.

>>> import torch, torch.fx
>>> from passes import meta
>>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
>>> for n in gm.graph.nodes:
...     meta.STAGE.set(n, 0 if n.name in ("input_1", "_0") else 1)
>>> prog = split_stages(gm)
>>> [dict(prog.stages[1].module.named_parameters())]
[{}]
>>> x = torch.ones(1, 2); torch.equal(prog.run(x), gm(x))
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from cost_model.errors import SMPPartitionError
from passes import in_place, meta


@dataclass(frozen=True)
class OutputRef:
    """A leaf of the program's output structure: index into the last stage's outputs."""

    index: int


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``module`` takes ``input_names`` positionally and returns a tuple
    ordered as ``output_names``."""

    index: int
    module: torch.fx.GraphModule
    input_names: tuple[str, ...]
    program_inputs: tuple[str, ...]
    recvs: tuple[tuple[int, tuple[str, ...]], ...]
    sends: tuple[tuple[int, tuple[str, ...]], ...]
    output_names: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, module=None))  # type: ignore[arg-type]
        d.pop("module")
        d["parameters"] = [n for n, _ in self.module.named_parameters()]
        return d


@dataclass(frozen=True)
class StagedProgram:
    """The stages of one program plus how to feed its inputs and rebuild its outputs."""

    stages: tuple[Stage, ...]
    placeholders: tuple[tuple[str, str, Any], ...]
    output_tree: Any
    in_spec: Any = None
    out_spec: Any = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def bind_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map the caller's ``model(*args, **kwargs)`` onto the program's placeholders."""
        if self.in_spec is not None:
            import torch.fx._pytree as fx_pytree

            flat = fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec)
            return {name: v for (name, _, _), v in zip(self.placeholders, flat)}
        out: dict[str, Any] = {}
        named = [(n, t, d) for n, t, d in self.placeholders if not t.startswith("*")]
        star = next((n for n, t, _ in self.placeholders if _is_star(t, 1)), None)
        star2 = next((n for n, t, _ in self.placeholders if _is_star(t, 2)), None)
        extra = set(kwargs) - {target for _, target, _ in named}
        if (extra and star2 is None) or (len(args) > len(named) and star is None):
            raise SMPPartitionError.build(
                "model called with arguments the traced forward does not take",
                sorted(extra) or f"{len(args)} positional", "DistributedModel.__call__",
                f"call it with the traced signature {[t for _, t, _ in self.placeholders]}")
        for i, (name, target, default) in enumerate(named):
            if i < len(args):
                out[name] = args[i]
            elif target in kwargs:
                out[name] = kwargs[target]
            elif default is not _NO_DEFAULT:
                out[name] = default
            else:
                raise SMPPartitionError.build(
                    "model call is missing a required argument", target,
                    "DistributedModel.__call__", "pass every argument the forward requires")
        if star is not None:  # ``forward(self, *inputs)``: fx's one placeholder, a tuple
            out[star] = tuple(args[len(named):])
        if star2 is not None:
            out[star2] = {k: kwargs[k] for k in extra}
        return out

    def build_outputs(self, last_outputs: tuple[Any, ...]) -> Any:
        """Rebuild the caller's output structure from the last stage's output tuple."""
        tree = _map_refs(self.output_tree, lambda r: last_outputs[r.index])
        if self.out_spec is not None:
            return pytree.tree_unflatten(list(tree), self.out_spec)
        return tree

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run the stages in order in this process (reference semantics, used by tests)."""
        inputs = self.bind_inputs(args, kwargs)
        env: dict[str, Any] = {}
        last: tuple[Any, ...] = ()
        for st in self.stages:
            vals = [inputs[n] if n in st.program_inputs else env[n] for n in st.input_names]
            outs = st.module(*vals)
            env.update(zip(st.output_names, outs))
            last = outs
        return self.build_outputs(last)

    def to_json(self) -> dict[str, Any]:
        return {"stages": [s.to_json() for s in self.stages],
                "placeholders": [[n, t] for n, t, _ in self.placeholders]}


class _NoDefault:
    def __repr__(self) -> str:
        return "<required>"


_NO_DEFAULT: Any = _NoDefault()


def _is_star(target: str, stars: int) -> bool:
    """``target`` is fx's placeholder for ``*args`` (1) or ``**kwargs`` (2)."""
    return target.startswith("*" * stars) and not target.startswith("*" * (stars + 1))


def _map_refs(tree: Any, fn: Any) -> Any:
    if isinstance(tree, OutputRef):
        return fn(tree)
    if isinstance(tree, tuple):
        items = tuple(_map_refs(t, fn) for t in tree)
        return type(tree)(*items) if hasattr(tree, "_fields") else items
    if isinstance(tree, list):  # fx's immutable_list becomes a plain list
        return [_map_refs(t, fn) for t in tree]
    if isinstance(tree, dict):  # fx's immutable_dict becomes a plain dict
        return {k: _map_refs(v, fn) for k, v in tree.items()}
    if isinstance(tree, slice):
        return slice(_map_refs(tree.start, fn), _map_refs(tree.stop, fn),
                     _map_refs(tree.step, fn))
    return tree


def _stage_of(node: torch.fx.Node) -> int:
    stage = meta.STAGE.get(node)
    if stage is None:
        raise SMPPartitionError.build(
            "every computing node needs a stage (passes.meta.STAGE) before split_stages",
            None, f"node={node.format_node()}",
            "run auto_partition or assign_manual first")
    if not isinstance(stage, int) or stage < 0:
        raise SMPPartitionError.build("a stage must be an integer >= 0", stage,
                                      f"node={node.format_node()}", "fix the partitioner")
    return stage


def split_stages(gm: torch.fx.GraphModule, num_stages: int | None = None) -> StagedProgram:
    """Build a ``StagedProgram`` from ``gm`` annotated with ``STAGE``; ``gm`` is not mutated.

    ``num_stages`` defaults to the largest stage + 1; a larger value leaves trailing stages
    empty (they pass the final outputs through)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    stage: dict[torch.fx.Node, int] = {n: _stage_of(n) for n in compute}
    in_place.check(gm, stage.__getitem__)
    p = max(stage.values(), default=0) + 1
    if num_stages is not None:
        if num_stages < p:
            raise SMPPartitionError.build("a node is assigned past the last stage", p - 1,
                                          f"split_stages(num_stages={num_stages})",
                                          "assign stages below num_stages")
        p = num_stages
    last = p - 1
    # Every value that crosses stages: producer stage must be lower than the consumer's.
    for n in compute:
        for m in n.all_input_nodes:
            if m in stage and stage[m] > stage[n]:
                raise SMPPartitionError.build(
                    "stages may only send forward: a node uses a value from a later stage",
                    f"stage {stage[m]} -> stage {stage[n]}",
                    f"node={n.format_node()} reads {m.name}",
                    "make the partition contiguous in a topological order")
    out_leaves = _output_leaves(output.args[0])
    users_on: dict[torch.fx.Node, set[int]] = {n: set() for n in nodes}
    for n in compute:
        for m in n.all_input_nodes:
            users_on[m].add(stage[n])
    for leaf in out_leaves:
        users_on[leaf].add(last)
    stage_nodes: list[list[torch.fx.Node]] = [[] for _ in range(p)]
    for n in compute:
        stage_nodes[stage[n]].append(n)
    stages = [_build_stage(gm, s, stage_nodes[s], stage, users_on, placeholders,
                           out_leaves if s == last else None, p) for s in range(p)]
    index = {n.name: i for i, n in enumerate(out_leaves)}
    tree = _map_nodes(output.args[0], lambda n: OutputRef(index[n.name]))
    ph = tuple((n.name, str(n.target), n.args[0] if n.args else _NO_DEFAULT)
               for n in placeholders)
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return StagedProgram(tuple(stages), ph, tree,
                         in_spec=getattr(info, "in_spec", None),
                         out_spec=getattr(info, "out_spec", None))


def _map_nodes(tree: Any, fn: Any) -> Any:
    return torch.fx.node.map_arg(tree, fn)


def _output_leaves(arg: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(arg, lambda n: found.append(n) if n not in found else None)
    return found


def _build_stage(gm: torch.fx.GraphModule, s: int, own: list[torch.fx.Node],
                 stage: dict[torch.fx.Node, int], users_on: dict[torch.fx.Node, set[int]],
                 placeholders: list[torch.fx.Node], final: list[torch.fx.Node] | None,
                 p: int) -> Stage:
    own_set = set(own)
    needed: list[torch.fx.Node] = []  # values read by this stage that it does not compute
    reads = [m for n in own for m in n.all_input_nodes] + list(final or [])
    for m in reads:
        if m not in own_set and m not in needed:
            needed.append(m)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    prog_inputs = [m for m in placeholders if m in needed]
    received = sorted((m for m in needed if m in stage), key=lambda m: (stage[m], order[m]))
    attrs = sorted((m for m in needed if m.op == "get_attr"), key=order.__getitem__)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for m in prog_inputs + received:
        env[m] = g.placeholder(m.name)
        env[m].meta = dict(m.meta)
    for m in attrs:
        env[m] = g.node_copy(m, env.__getitem__)
    for n in own:
        env[n] = g.node_copy(n, env.__getitem__)
    if final is not None:
        out_nodes = list(final)
    else:
        out_nodes = [n for n in own if any(u > s for u in users_on[n])]
    g.output(tuple(env[n] for n in out_nodes))
    module = torch.fx.GraphModule(gm, g, class_name=f"Stage{s}")
    recvs: dict[int, list[str]] = {}
    for m in received:
        recvs.setdefault(stage[m], []).append(m.name)
    sends: dict[int, list[str]] = {}
    if final is None:
        for n in out_nodes:
            for u in sorted(users_on[n]):
                if u > s:
                    sends.setdefault(u, []).append(n.name)
    return Stage(
        index=s, module=module,
        input_names=tuple(m.name for m in prog_inputs + received),
        program_inputs=tuple(m.name for m in prog_inputs),
        recvs=tuple((k, tuple(v)) for k, v in sorted(recvs.items())),
        sends=tuple((k, tuple(v)) for k, v in sorted(sends.items())),
        output_names=tuple(n.name for n in out_nodes))
