"""Attach a ``NodeCost`` to every node: FLOPs, bytes, saved activations, time.

Ops are named canonically first so one table of formulas serves both front ends; unknown
ops are logged once. Saved values are counted as autograd keeps them: once per storage,
never for parameters. See docs/partitioning.md, 'Costs'.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from cost_model.device import DeviceSpec
from cost_model.errors import SMPTracingError, one_line
from cost_model.flops import CREATION_OPS, LOSS_COST, VIEW_OPS, gemm_dims, numel, op_flops
from cost_model.measure import fake_module_cost, real_module_cost
from cost_model.node_cost import NodeCost
from cost_model.roofline import fp8_cast_times, node_times
from cost_model.saved import saved_rule
from cost_model.waves import wave_gemm
from passes.graph_utils import copy_graph_module
from passes.meta import COST, GEMM, GEMM_DTYPE, PARAMS, SAVED, TENSOR
from passes.shape_prop import TensorInfo, total_nbytes

log = logging.getLogger("smp_fx.cost")
_warned: set[str] = set()


@dataclass(frozen=True)
class SavedValues:
    """What one node keeps for backward, before deduplication across nodes.

    ``keys`` name values by the node owning the storage, so views share a key; ``extra``
    counts tensors created only to be saved."""

    keys: tuple[tuple[str, int], ...] = ()
    extra: int = 0
    storage: tuple[str, int] = ("", 0)

MODULE_OPS: dict[type, str] = {
    nn.Linear: "linear", nn.Conv1d: "conv", nn.Conv2d: "conv", nn.Conv3d: "conv",
    nn.BatchNorm1d: "batch_norm", nn.BatchNorm2d: "batch_norm", nn.BatchNorm3d: "batch_norm",
    nn.LayerNorm: "layer_norm", nn.GroupNorm: "group_norm", nn.Embedding: "embedding",
    nn.ReLU: "relu", nn.GELU: "gelu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.SiLU: "silu",
    nn.Softmax: "softmax", nn.LogSoftmax: "log_softmax", nn.Dropout: "dropout",
    nn.Identity: "identity", nn.Flatten: "flatten", nn.AdaptiveAvgPool1d: "adaptive_avg_pool",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool", nn.AvgPool2d: "avg_pool",
    nn.MaxPool2d: "max_pool", nn.LeakyReLU: "leaky_relu", nn.Hardtanh: "hardtanh",
}

ALIASES = {
    "scaled_dot_product_attention": "sdpa", "native_layer_norm": "layer_norm",
    "conv1d": "conv", "conv2d": "conv", "conv3d": "conv", "convolution": "conv",
    "native_batch_norm": "batch_norm", "native_batch_norm_legit": "batch_norm",
    "native_batch_norm_legit_functional": "batch_norm", "native_dropout": "dropout",
    "adaptive_avg_pool1d": "adaptive_avg_pool", "adaptive_avg_pool2d": "adaptive_avg_pool",
    "avg_pool2d": "avg_pool", "max_pool2d": "max_pool", "max_pool2d_with_indices": "max_pool",
    "softmax_int": "softmax", "safe_softmax": "softmax", "split_tensor": "split",
    "unsafe_view": "view", "contiguous": "contiguous", "sym_size_int": "sym_size",
    "numpy_T": "permute", "grouped_mm_fallback": "grouped_mm",
}
COPY_OPS = frozenset({"contiguous", "clone", "_to_copy", "reshape"})
"""View-like ops that copy when their input is not contiguous."""
NO_GRAD_OPS = CREATION_OPS - frozenset({"cat", "stack", "triu", "tril", "index_select",
                                        "gather", "repeat", "diff", "repeat_interleave",
                                        "topk", "index_put"})
"""Ops whose output needs no gradient whatever their inputs (the 0-FLOP creation ops less
those that carry their inputs' values: a concatenation, a gather, a triangle)."""


def op_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """Canonical op name of a node (see ``cost_model.flops``)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        for cls in type(mod).__mro__:
            if cls in MODULE_OPS:
                return MODULE_OPS[cls]
        return f"module:{type(mod).__name__}"
    target = node.target
    if node.op == "call_method":
        name = str(target)
    elif isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
    elif target is operator.getitem:
        name = "getitem"
    else:
        name = getattr(target, "__name__", str(target))
    name = name.strip("_") if name not in ("_to_copy", "_unsafe_view") else name
    return ALIASES.get(name, name)


def _attrs(node: torch.fx.Node, op: str, gm: torch.fx.GraphModule) -> dict[str, Any]:
    """What a formula needs beyond input shapes: module hyper-parameters, dropout p."""
    if node.op == "call_module":
        mod: Any = gm.get_submodule(str(node.target))  # attributes differ per module type
        if op == "conv":
            return {"weight": tuple(mod.weight.shape), "groups": mod.groups}
        if op == "layer_norm":
            return {"norm_dims": len(mod.normalized_shape)}
        if op == "group_norm":
            return {"groups": mod.num_groups}
        if op in ("batch_norm",):
            return {"training": mod.training}
        if op == "dropout":
            return {"p": mod.p, "training": mod.training}
        return {}
    args, kwargs = node.args, node.kwargs
    if op == "layer_norm" and len(args) > 1:
        return {"norm_dims": len(args[1]) if isinstance(args[1], (list, tuple)) else 1}
    if op == "embedding" and node.op == "call_function":
        return {"indices_pos": 1}
    if op == "dropout":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
        return {"p": p, "training": training}
    if op == "conv" and len(args) > 6:
        return {"groups": args[-1] if isinstance(args[-1], int) else 1}
    return {}


def _inputs(node: torch.fx.Node) -> list[Any]:
    return list(node.args) + [v for v in node.kwargs.values() if isinstance(v, torch.fx.Node)]


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.fx.Node):
        info = TENSOR.get(value)
        if isinstance(info, TensorInfo):
            return info.shape
    return None


class _State:
    """Walks the graph once, tracking grad-requirement, storage aliasing and first uses."""

    def __init__(self, gm: torch.fx.GraphModule, real_run: bool = True) -> None:
        self.gm = gm
        self.real_run = real_run  # a leaf fakes cannot run may run on real zeros
        self.rg: dict[str, bool] = {}
        self.base: dict[str, tuple[str, Any]] = {}
        self.counted: set[tuple[str, Any]] = set()
        self.saved: dict[str, tuple[tuple[tuple[str, int], ...], int]] = {}
        self.seen_params: set[int] = set()
        self.nodes: dict[str, torch.fx.Node] = {n.name: n for n in gm.graph.nodes}
        self.fp8_cast: set[str] = set()  # values already cast to FP8 by an FP8 linear

    def tensor_of(self, name: str) -> torch.Tensor:
        try:
            return self.gm.get_parameter(name)
        except AttributeError:
            return self.gm.get_buffer(name)

    def key_bytes(self, key: tuple[str, Any]) -> int:
        node_name, idx = key
        info = TENSOR.get(self.nodes[node_name])
        if isinstance(idx, tuple):  # ("copy", bytes)
            return int(idx[1])
        if idx is not None and isinstance(info, tuple):
            return total_nbytes(info[idx]) if idx < len(info) else 0
        return total_nbytes(info)


def _is_float(info: Any) -> bool:
    return isinstance(info, TensorInfo) and (info.dtype.startswith("float")
                                             or info.dtype.startswith("bfloat")
                                             or info.dtype.startswith("complex"))


def annotate_costs(gm: torch.fx.GraphModule, device: DeviceSpec,
                   measured: Mapping[str, Sequence[float | None]] | None = None,
                   allow_real_run: bool = True) -> torch.fx.GraphModule:
    """A copy of ``gm`` with ``COST`` on every node; ``measured`` nodes take measured numbers
    (a ``None`` field keeps the analytic one). ``allow_real_run=False`` (SMP's
    ``skip_tracing``): a leaf that fake tensors cannot run keeps an unknown cost instead of
    being run on real zeros."""
    out = copy_graph_module(gm)
    st = _State(out, allow_real_run)
    for node in out.graph.nodes:
        cost = _node_cost(node, st, device, measured or {})
        COST.set(node, cost)
        keys, extra = st.saved.get(node.name, ((), cost.saved_bytes))
        base = st.base.get(node.name, (node.name, None))
        SAVED.set(node, SavedValues(keys, extra, (_key_name(base), st.key_bytes(base))))
    return out


def _key_name(key: tuple[str, Any]) -> str:
    name, idx = key
    if isinstance(idx, tuple):  # ("copy", bytes, input position)
        return f"{name}#copy{idx[2]}"
    return name if idx is None else f"{name}[{idx}]"


def _node_cost(node: torch.fx.Node, st: _State, device: DeviceSpec,
               measured: Mapping[str, Sequence[float | None]]) -> NodeCost:
    op = op_name(node, st.gm)
    info = TENSOR.get(node)
    out_bytes = total_nbytes(info)
    params = [st.tensor_of(p) for p in PARAMS.get(node, ())]
    params_rg = any(p.requires_grad for p in params)
    in_nodes = _inputs(node)
    in_rg = [st.rg.get(a.name, False) if isinstance(a, torch.fx.Node) else False
             for a in in_nodes]
    _track_alias(node, op, st)
    if node.op == "get_attr":
        st.rg[node.name] = params_rg
        return NodeCost(op=op, output_bytes=out_bytes)
    if node.op in ("placeholder", "output"):
        st.rg[node.name] = False
        return NodeCost(op=op, output_bytes=out_bytes if node.op == "placeholder" else 0)
    # every input counts, those inside a list too (cat, stack)
    grad_in = any(st.rg.get(a.name, False) for a in node.all_input_nodes)
    st.rg[node.name] = (grad_in or params_rg) and op not in NO_GRAD_OPS \
        and (_is_float(info) or isinstance(info, tuple))
    param_bytes = 0
    for p in params:
        if id(p) not in st.seen_params:
            st.seen_params.add(id(p))
            param_bytes += p.numel() * p.element_size()
    shapes = [_shape(a) for a in in_nodes]
    out_shape = info.shape if isinstance(info, TensorInfo) else None
    attrs = _attrs(node, op, st.gm)
    if op == "dropout" and device.name == "cpu" and isinstance(info, TensorInfo):
        # torch's CPU dropout multiplies by a noise tensor of the input's dtype
        attrs["mask_itemsize"] = getattr(torch, info.dtype).itemsize
    if op in LOSS_COST and isinstance(info, TensorInfo):  # the loss is in the logits' dtype
        attrs["logits_itemsize"] = getattr(torch, info.dtype).itemsize
    flops = op_flops(op, shapes, out_shape, attrs)
    rule = saved_rule(op, shapes, out_shape, attrs, in_rg, params_rg)
    known = flops is not None and rule is not None
    leaf_saved: int | None = None
    if not known and node.op == "call_module":  # an opaque leaf: decompose it on fakes
        leaf = _leaf_cost(node, in_rg, st)
        if leaf is not None:
            flops, leaf_saved, known = (leaf[0], leaf[1]), leaf[2], True
    if not known and op not in _warned:
        _warned.add(op)
        log.warning("cost model: no formula for op %r (first seen at node %s); counting "
                    "0 FLOPs and its output as saved", op, node.format_node())
    fwd_flops, bwd_flops = flops if flops is not None else (0.0, 0.0)
    if leaf_saved is not None:
        saved = leaf_saved
    elif rule is not None:
        saved = _saved_bytes(node, rule, in_nodes, st)
    else:
        saved = out_bytes if st.rg[node.name] else 0
        if saved:
            st.saved[node.name] = (((node.name, out_bytes),), 0)
    moved = sum(st.key_bytes((a.name, None)) for a in in_nodes
                if isinstance(a, torch.fx.Node)) + out_bytes
    moved += sum(p.numel() * p.element_size() for p in params)
    dtype = info.dtype if isinstance(info, TensorInfo) else "float32"
    math_dtype = GEMM_DTYPE.get(node)  # an FP8 linear (passes.fp8_linears)
    gemm = gemm_dims(op, shapes, out_shape, attrs)
    waved = wave_gemm(op, gemm, out_shape)
    if waved is not None:
        GEMM.set(node, (waved, waved))
    if _plain_getitem(node, op):
        fwd_t = bwd_t = 0.0
    else:
        fwd_t, bwd_t = node_times(op, device, fwd_flops=fwd_flops, bwd_flops=bwd_flops,
                                  out_elems=_elements(info), moved=moved,
                                  dtype=math_dtype or dtype,
                                  gemm_dim=min(gemm) if gemm else None,
                                  module=node.op == "call_module", backward=st.rg[node.name],
                                  seq=gemm[2] if gemm and op == "sdpa" else None,
                                  head_dim=gemm[1] if gemm and op == "sdpa" else None,
                                  gemm=waved)
        if math_dtype:
            first = casts_fp8_input(node, st.fp8_cast)
            cast_f, cast_b = fp8_cast_times(math.prod(shapes[0]) if first and shapes[0]
                                            else 0, _elements(info), device)
            fwd_t, bwd_t = fwd_t + cast_f, bwd_t + (cast_b if st.rg[node.name] else 0.0)
    cost = NodeCost(fwd_flops=fwd_flops, bwd_flops=bwd_flops, fwd_time_s=fwd_t,
                    bwd_time_s=bwd_t, param_bytes=param_bytes, output_bytes=out_bytes,
                    saved_bytes=saved, op=op, known=known)
    if node.name in measured:
        # a field measured as None keeps its analytic value (times only, or memory only)
        fwd_s, bwd_s, *mem = measured[node.name]
        mem_bytes = mem[0] if mem and mem[0] is not None else saved
        cost = NodeCost(fwd_flops=fwd_flops, bwd_flops=bwd_flops,
                        fwd_time_s=fwd_t if fwd_s is None else float(fwd_s),
                        bwd_time_s=bwd_t if bwd_s is None else float(bwd_s),
                        param_bytes=param_bytes,
                        output_bytes=out_bytes, saved_bytes=int(mem_bytes), measured=True,
                        op=op, known=known)
    return cost


def casts_fp8_input(node: torch.fx.Node, cast: set[str]) -> bool:
    """Whether FP8 linear ``node`` casts its input, the first of those reading it (q, k and
    v share one cast), recording the input in ``cast`` (the values cast so far, in graph
    order); what ``annotate_costs`` prices and ``benchmarks/gemm_shapes.py`` times."""
    x = node.args[0] if node.args else None
    read = x.name if isinstance(x, torch.fx.Node) else ""
    if not read or read in cast:
        return False
    cast.add(read)
    return True


def _plain_getitem(node: torch.fx.Node, op: str) -> bool:
    """Taking an element of a tuple output is plain Python: no op, no time."""
    src = node.args[0] if node.args else None
    return op == "getitem" and isinstance(src, torch.fx.Node) and not isinstance(
        TENSOR.get(src), TensorInfo)


def _elements(info: Any) -> int:
    if isinstance(info, TensorInfo):
        return math.prod(info.shape)
    if isinstance(info, tuple):
        return sum(math.prod(x.shape) for x in info if isinstance(x, TensorInfo))
    return 0


def _leaf_cost(node: torch.fx.Node, in_rg: list[bool], st: _State
               ) -> tuple[float, float, int] | None:
    """Price a leaf module with no formula by running it on fake tensors (see
    ``cost_model.measure.fake_module_cost``); one that branches on its values (fakes have
    none) on real zeros where its weights are real (``real_module_cost``); ``None`` if
    neither can run it."""
    rg = dict(zip(node.args, in_rg))
    module = st.gm.get_submodule(str(node.target))
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")

    def value(a: Any, real: bool) -> Any:
        info = TENSOR.get(a) if isinstance(a, torch.fx.Node) else None
        if isinstance(a, torch.fx.Node) and not isinstance(info, TensorInfo):
            raise SMPTracingError.build("a leaf priced on fake tensors takes single tensors",
                                        a.name, f"leaf {node.name}",
                                        "it keeps an unknown cost (a formula can price it)")
        if info is None:
            return a
        dtype = getattr(torch, info.dtype)
        t = torch.zeros(info.shape, dtype=dtype, device=device) if real else torch.empty(
            info.shape, dtype=dtype)
        return t.requires_grad_(rg.get(a, False) and t.is_floating_point())

    def inputs(real: bool) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
        return lambda: (tuple(value(a, real) for a in node.args),
                        {k: value(v, real) for k, v in node.kwargs.items()})

    try:
        return fake_module_cost(module, inputs(False))
    except Exception as exc:  # data-dependent code cannot run on fakes
        why = one_line(exc, 200)
    if not st.real_run or any(t.is_meta for t in tensors):
        log.info("cannot decompose leaf %s on fake tensors (%s), nor on real ones: %s",
                 node.target, why, "skip_tracing" if not st.real_run else
                 "its weights are on meta")
        return None
    try:
        cost = real_module_cost(module, inputs(True))
    except Exception as exc:
        log.info("cannot decompose leaf %s on fake tensors (%s), nor on real zeros (%s)",
                 node.target, why, one_line(exc, 200))
        return None
    log.info("leaf %s decomposed on real zeros: fake tensors cannot run it (%s)",
             node.target, why)
    return cost


def _contiguous(node: Any) -> bool:
    info = TENSOR.get(node) if isinstance(node, torch.fx.Node) else None
    return info.contiguous if isinstance(info, TensorInfo) else True


def _track_alias(node: torch.fx.Node, op: str, st: _State) -> None:
    """Record which stored value (node, tuple index) this node's output aliases."""
    src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    own = (node.name, None)
    if src is None or node.op not in ("call_function", "call_method", "call_module"):
        st.base[node.name] = own
        return
    if op == "getitem" and isinstance(TENSOR.get(src), tuple):
        if op_name(src, st.gm) in VIEW_OPS:  # split/chunk/unbind: alias the split's input
            st.base[node.name] = st.base[src.name]
        else:
            idx = node.args[1] if isinstance(node.args[1], int) else None
            st.base[node.name] = (src.name, idx)
        return
    if op == "dropout":
        attrs = _attrs(node, op, st.gm)
        if not attrs.get("training", True) or float(attrs.get("p", 0.5)) == 0.0:
            op = "identity"  # dropout that is switched off returns its input
    if op in COPY_OPS:
        copies = op in ("clone", "_to_copy") or not _contiguous(src)
        st.base[node.name] = own if copies else st.base[src.name]
        return
    if op in VIEW_OPS and op not in CREATION_OPS:
        st.base[node.name] = st.base.get(src.name, (src.name, None))
        return
    st.base[node.name] = own


def _matmul_copy(node: torch.fx.Node, arg: torch.fx.Node, st: _State) -> int | None:
    """Bytes of the copy a batched matmul makes of operand ``arg`` and saves in its place
    (None: it saves ``arg`` itself). ``torch.matmul`` folds its operands into 3-D ones by
    reshaping: a non-contiguous operand is copied, and one broadcast over the other's batch
    dimensions (a key or value shared by several heads: multi-query and grouped-query
    attention) is copied at the broadcast size."""
    shape, out = _shape(arg), _shape(node)
    size = st.key_bytes((arg.name, None))
    if shape and out and len(shape) >= 3 and len(out) >= 3 and numel(shape) \
            and numel(shape[:-2]) < numel(out[:-2]):
        return size // numel(shape) * numel(out[:-2]) * shape[-2] * shape[-1]
    return None if _contiguous(arg) else size


def _saved_bytes(node: torch.fx.Node, rule: Any, in_nodes: list[Any], st: _State) -> int:
    keys: list[tuple[str, Any]] = []
    for pos in rule.inputs:
        arg = in_nodes[pos] if pos < len(in_nodes) else None
        if not isinstance(arg, torch.fx.Node):
            continue
        base = st.base.get(arg.name, (arg.name, None))
        if st.nodes[base[0]].op == "get_attr":
            continue  # parameters and buffers are not activations
        op = op_name(node, st.gm)
        copied = _matmul_copy(node, arg, st) if op in ("matmul", "bmm") else None
        if copied is not None:
            keys.append((node.name, ("copy", copied, pos)))
            continue
        keys.append(base)
    keys += [(node.name, i) for i in rule.output_items]
    if rule.output:
        keys.append(st.base.get(node.name, (node.name, None)))
    st.saved[node.name] = (tuple((_key_name(k), st.key_bytes(k)) for k in dict.fromkeys(keys)),
                           rule.extra_bytes)
    total = rule.extra_bytes
    for key in keys:
        if key not in st.counted:
            st.counted.add(key)
            total += st.key_bytes(key)
    return total
