"""A captured graph handed from the process that exported it to others holding the same model.

Why: every rank of a job captures the whole model (each plans the same stages from it), so
the ranks on one host export the same model at once, each paying torch.export's symbolic
reasoning on a shared CPU (0.7-9 CPU-s for a tiny Hugging Face model, minutes for a large
one). One of them can export and hand the graph on: ``to_bytes`` pickles the normalised
graph (nodes, their metadata with the fake tensors and symbolic shapes, the input and
output pytree specs) without the model's tensors, and ``from_bytes`` rebuilds it around the
receiving process's own parameters, buffers and tensor attributes, as its own export
would have them. Loading costs a sixth of exporting (median 0.17, worst 0.19 over the 27
architectures of ``examples/models/hf_zoo.py``, Swin 1.43 against 8.63 CPU-s;
``python benchmarks/trace_share.py``).

Which processes hold "the same model" is ``digest``: ``passes.trace_memo``'s key (the
classes and functions, module attributes, parameter and buffer shapes, dtypes and ties,
the inputs' shapes, autograd / autocast state) as text, with the devices of the model's
tensors and of the inputs (``cuda:0`` and ``cuda:1`` differ: a graph bakes in the device
of the constants it makes); a key whose text names an object by its address differs
between processes, and then nothing is shared. How the bytes
travel is the caller's (``ExportShare``: ``smp_fx.runtime.planning.shared_export`` sends
them between the ranks of a host). It needs torch's graph pickler
(``torch.fx._graph_pickler``); without it ``available()`` says why and every process
exports for itself.
"""

from __future__ import annotations

import hashlib
import pickle
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from passes import trace_memo
from passes.graph_utils import copy_graph_module, owner_of, tensor_at

DROPPED_META = frozenset({"source_fn_stack", "fwd_source_fn_stack"})
"""Node metadata not carried over (it holds functions; nothing downstream reads it)."""


class ExportShare(Protocol):
    """Runs ``export`` here, or obtains its result from a process that ran it."""

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            export: Callable[[], torch.fx.GraphModule]) -> torch.fx.GraphModule: ...


def available() -> str | None:
    """None where graphs can be handed on; else why not."""
    try:
        from torch.fx._graph_pickler import GraphPickler  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no graph pickler ({exc})"
    return None


def digest(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[str | None, str]:
    """(hex digest, "") of what an export of ``model`` at these inputs depends on, or
    (None, why it has none)."""
    key, why = trace_memo.model_key(model, args, kwargs)
    if key is None:
        return None, why
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))]
    devices = sorted({str(t.device) for t in tensors})  # the key has device types only
    return hashlib.sha256(repr((key, devices)).encode()).hexdigest(), ""


def _graph_tensors(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor the graph holds by name: parameters, buffers (tied names each) and the
    tensor attributes its ``get_attr`` nodes read."""
    named: dict[str, torch.Tensor] = dict(gm.named_parameters(remove_duplicate=False))
    named.update(gm.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = tensor_at(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                named[str(node.target)] = value
    return named


def _model_tensors(gm: torch.fx.GraphModule, model: nn.Module) -> dict[str, torch.Tensor]:
    """The graph's tensors that are the model's own, by name: what is left out of the
    bytes and rebound on arrival."""
    return {name: t for name, t in _graph_tensors(gm).items() if tensor_at(model, name) is t}


def _kinds(gm: torch.fx.GraphModule) -> dict[str, str]:
    """How the graph holds each of its tensors: ``parameter``, ``buffer``, ``non-persistent``
    (a buffer left out of ``state_dict()``) or ``attribute`` (a plain tensor attribute:
    export's lifted constants). Torch's graph pickler brings every tensor that is not a
    parameter back as a persistent buffer, which would put the model's non-persistent
    buffers and the lifted constants into the graph's ``state_dict()``."""
    kinds: dict[str, str] = {}
    for name in _graph_tensors(gm):
        owner, leaf = owner_of(gm, name)
        kinds[name] = ("parameter" if leaf in owner._parameters else
                       "attribute" if leaf not in owner._buffers else
                       "non-persistent" if leaf in owner._non_persistent_buffers_set else
                       "buffer")
    return kinds


def _restore_kinds(gm: torch.fx.GraphModule, kinds: dict[str, str]) -> None:
    for name, kind in kinds.items():
        owner, leaf = owner_of(gm, name)
        if kind == "attribute" and leaf in owner._buffers:
            value = owner._buffers.pop(leaf)
            owner._non_persistent_buffers_set.discard(leaf)
            object.__setattr__(owner, leaf, value)
        elif kind == "non-persistent" and leaf in owner._buffers:
            owner._non_persistent_buffers_set.add(leaf)


def _set(gm: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, leaf = owner_of(gm, name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor  # type: ignore[assignment]
    elif leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    else:
        setattr(owner, leaf, tensor)


def to_bytes(gm: torch.fx.GraphModule, model: nn.Module) -> bytes:
    """``gm`` (captured from ``model``) as bytes, the model's tensors left out (meta
    stand-ins of their shapes); ``gm`` itself is not changed."""
    from torch.fx._graph_pickler import GraphPickler, Options

    plain = copy_graph_module(gm)  # over a copy of the graph: gm's stays gm's
    for name, tensor in _model_tensors(gm, model).items():
        stand_in = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
        _set(plain, name, stand_in)
    options = Options(ops_filter=None, node_metadata_key_filter=lambda k: k not in DROPPED_META)
    return pickle.dumps((GraphPickler.dumps(plain, options), _kinds(gm)))


def from_bytes(data: bytes, model: nn.Module) -> torch.fx.GraphModule:
    """The graph ``to_bytes`` made from a model of the same digest, holding ``model``'s
    own tensors where the sender's were left out."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    graph, kinds = pickle.loads(data)
    with warnings.catch_warnings():  # torch's unpickler reading its own TreeSpecs
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)
        gm = GraphPickler.loads(graph, FakeTensorMode(shape_env=ShapeEnv()))
    assert isinstance(gm, torch.fx.GraphModule)
    _restore_kinds(gm, kinds)
    for name, stand_in in _stand_ins(gm).items():
        mine = tensor_at(model, name)
        if not isinstance(mine, torch.Tensor) or mine.shape != stand_in.shape \
                or mine.dtype != stand_in.dtype:
            raise ValueError(f"the model has no tensor {name!r} of shape "
                             f"{tuple(stand_in.shape)} and {stand_in.dtype}")
        _set(gm, name, mine)
    gm.recompile()
    return gm


def _stand_ins(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The meta tensors ``to_bytes`` put where the sender's model's tensors were."""
    return {name: t for name, t in _graph_tensors(gm).items() if t.is_meta}


__all__ = ["DROPPED_META", "ExportShare", "available", "digest", "from_bytes", "to_bytes"]
