"""Front end: capture a user's ``nn.Module`` as a runnable fx ``GraphModule``.

``fx`` (symbolic, untraceable submodules made leaves), ``export`` (non-strict, symbolic
input dimensions) or ``auto``; either way names, input order, ``MODULE_PATH`` and
``PARAMS`` follow one contract, and nothing runs on real tensors. See
docs/partitioning.md, 'Front end', and docs/architecture.md, 'Contracts'.
"""

from __future__ import annotations

import inspect
import io
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, redirect_stderr
from typing import Any, Literal

import torch
import torch.fx
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree
from torch import nn

from cost_model.errors import SMPTracingError, one_line
from passes import export_cache, trace_memo
from passes.fresh_writes import make_out_of_place
from passes.graph_utils import attach_state
from passes.input_dims import InputDims, auto_dynamic_shapes, input_dims_of, range_constraints
from passes.meta import MODULE_PATH, PARAMS
from passes.model_outputs import capture_outputs
from passes.trace_share import ExportShare

log = logging.getLogger("smp_fx.passes.trace")

Frontend = Literal["auto", "fx", "export"]
LeafSpec = Iterable[type | str]

MAX_AUTO_LEAVES = 32
"""How many untraceable submodules may be turned into leaves before fx gives up."""

class _LeafTracer(torch.fx.Tracer):
    """fx tracer with a leaf policy that remembers which module was being traced on failure."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.path_stack: list[str] = [""]
        self.failed_path: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = self.path_of_module(m)
        self.path_stack.append(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_path is None:  # innermost module records itself first
                self.failed_path = path
            raise
        finally:
            self.path_stack.pop()

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any,
                    name: str | None = None, type_expr: Any = None) -> torch.fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        MODULE_PATH.set(node, target if kind == "call_module" else self.path_stack[-1])
        return node


def _split_leaf_spec(leaf_modules: LeafSpec) -> tuple[tuple[type, ...], frozenset[str]]:
    types = tuple(x for x in leaf_modules if isinstance(x, type))
    paths = frozenset(x for x in leaf_modules if isinstance(x, str))
    bad = [x for x in leaf_modules if not isinstance(x, (type, str))]
    if bad:
        raise SMPTracingError.build(
            "leaf_modules entries must be nn.Module types or module paths", bad,
            fix="pass e.g. leaf_modules=(MyBlock, 'encoder.layer.3')")
    return types, paths


def _param_names_by_module(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """FQNs (tied aliases included) of the parameters and buffers each module owns."""
    out: dict[str, tuple[str, ...]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        names = [n for n, _ in mod.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in mod.named_buffers(remove_duplicate=False)]
        prefix = f"{path}." if path else ""
        out[path] = tuple(prefix + n for n in names)
    return out


def _record_params(gm: torch.fx.GraphModule) -> None:
    """Set ``PARAMS``: a get_attr node reads its target; a call_module leaf all its own
    parameters; any other node the parameters of the get_attr nodes among its inputs."""
    owned = _param_names_by_module(gm)
    attr_names = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    attr_names |= {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            PARAMS.set(node, (node.target,) if node.target in attr_names else ())
        elif node.op == "call_module":
            PARAMS.set(node, owned.get(node.target, ()))
        else:
            names = [a.target for a in node.all_input_nodes
                     if a.op == "get_attr" and a.target in attr_names]
            PARAMS.set(node, tuple(dict.fromkeys(names)))


CONSTANT_TYPES = (type(None), bool, int, float, str)


def constant_inputs(model: nn.Module, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``forward`` parameters this call passes as a constant (None, bool, number, str),
    traced as constants so ``if labels is not None`` follows the call; another value later
    fails the trace's assertion by name."""
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # no readable signature, or a call it does not take
        return {}
    out: dict[str, Any] = {}
    for name, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = bound.arguments[name] if name in bound.arguments else param.default
        if value is not param.empty and type(value) in CONSTANT_TYPES:
            out[name] = value
    return out


def _restore_placeholder_names(graph: torch.fx.Graph, fixed: Mapping[str, Any]) -> None:
    """fx names a ``concrete_args`` placeholder ``{name}_1``; callers pass it by keyword,
    so it gets its parameter's name back."""
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.target, str) and \
                node.target.endswith("_1") and node.target[:-2] in fixed:
            node.target = node.target[:-2]
            node._rename(node.target)


def _fx_trace(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              leaf_modules: LeafSpec,
              auto_leaf: bool) -> tuple[torch.fx.GraphModule, list[str]]:
    """Symbolic trace; on failure make the failing submodule a leaf and retry."""
    leaf_types, leaf_paths = _split_leaf_spec(leaf_modules)
    fixed = constant_inputs(model, args, kwargs)
    auto: list[str] = []
    while True:
        tracer = _LeafTracer(leaf_types, leaf_paths | frozenset(auto))
        try:
            graph = tracer.trace(model, concrete_args=fixed or None)
            _restore_placeholder_names(graph, fixed)
        except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
            where = tracer.failed_path
            if not auto_leaf or not where or len(auto) >= MAX_AUTO_LEAVES:
                raise _FxFailure(where or "", exc) from exc
            log.info("fx: module %r (%s) cannot be traced symbolically (%s: %s); "
                     "making it a leaf", where, type(model.get_submodule(where)).__name__,
                     type(exc).__name__, exc)
            auto.append(where)
            continue
        gm = torch.fx.GraphModule(model, graph, model.__class__.__name__)
        attach_state(gm, model)  # e.g. a tied alias the graph never reads
        return gm, auto


class _FxFailure(Exception):
    def __init__(self, path: str, exc: BaseException) -> None:
        super().__init__(f"{path}: {exc}")
        self.path = path
        self.exc = exc


def _module_path_from_stack(node: torch.fx.Node, leaf_paths: frozenset[str],
                            modules: frozenset[str]) -> str:
    """The innermost real module on the node's ``nn_module_stack`` (export also records
    hooks there, e.g. for the size nodes of symbolic dimensions)."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    for value in stack.values():
        candidate = value[0] if isinstance(value, tuple) else ""
        if path in leaf_paths:  # a user leaf: everything inside it belongs to the leaf
            break
        if candidate in modules:
            path = candidate
    return path


def _export_trace(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                  leaf_modules: LeafSpec) -> torch.fx.GraphModule:
    """Non-strict export; normalised to the trace contract (inputs first, no guard node)."""
    _, leaf_paths = _split_leaf_spec(leaf_modules)
    ep = _export_or_recall(model, args, kwargs)
    gm = ep.module()
    gm.meta["smp.range_constraints"] = range_constraints(ep)
    graph = gm.graph
    for node in list(graph.nodes):  # the shape guard is not part of the computation
        if node.op == "call_module" and str(node.target).startswith("_guards") and not node.users:
            graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    _order_placeholders(graph, placeholders)
    make_out_of_place(graph)
    modules = frozenset(n for n, _ in model.named_modules(remove_duplicate=False))
    for node in graph.nodes:
        MODULE_PATH.set(node, _module_path_from_stack(node, leaf_paths, modules))
    graph.lint()
    gm.recompile()
    if set(gm.state_dict()) != set(model.state_dict()):
        raise SMPTracingError.build(
            "torch.export changed the parameter/buffer names",
            sorted(set(gm.state_dict()) ^ set(model.state_dict()))[:5], "export front end",
            "use frontend='fx' with leaf_modules for the offending submodules")
    return gm


def _export_or_recall(model: nn.Module, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any]) -> Any:
    """The program of an earlier export of a model of the same structure at the same
    inputs, holding this model's tensors (``passes.trace_memo``); else a new export."""
    key, why = trace_memo.model_key(model, args, kwargs) if trace_memo.enabled() \
        else (None, f"{trace_memo.ENV}=0")
    if key is not None:
        ep = trace_memo.recall(key, model)
        if ep is not None:
            log.info("export: reused the program of a model of the same structure and inputs "
                     "exported earlier in this process")
            return ep
    remove_hook = capture_outputs(model)  # outputs torch's pytree does not know (4.2x HF)
    try:
        ep = _export(model, args, kwargs)
    finally:
        remove_hook()
    if key is not None:
        trace_memo.remember(key, ep, model)
    else:
        trace_memo.unkeyed(why)
    return ep


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Non-strict export with every input dimension symbolic where the model allows, first
    size-obliviously; failing both, specialised to these shapes."""
    dynamic = auto_dynamic_shapes(model, args, kwargs)
    with _meta_weights_on(_run_device(model, args, kwargs)):
        for oblivious in (True, False):
            try:
                patch = fx_config.patch(backed_size_oblivious=oblivious)  # type: ignore[attr-defined]
                with patch, partial_graph_to_debug():
                    return torch.export.export(model, args, dict(kwargs),
                                               dynamic_shapes=dynamic, strict=False)
            except Exception as exc:  # export raises many types; the static retry tells the rest
                log.info("export with symbolic input dimensions (size-oblivious: %s) failed "
                         "(%s)", oblivious, one_line(exc))
        log.info("exporting with the example's shapes")
        with partial_graph_to_debug():
            return torch.export.export(model, args, dict(kwargs), strict=False)


@contextmanager
def partial_graph_to_debug() -> Iterator[None]:
    """One export attempt, with the partial graph ``torch.export`` prints to stderr when it
    fails (~1400 lines for a tiny Hugging Face BART in fp16, whose layers branch on their
    values; three attempts a model) sent to this module's DEBUG log instead: smp-fx
    retries and logs each failure itself, so a handled failure prints one INFO line.
    Whatever else is written to stderr meanwhile is passed on after the attempt."""
    held = io.StringIO()
    graph = None
    try:
        with redirect_stderr(held):
            yield
    except Exception as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        raise
    finally:
        text = held.getvalue()
        if isinstance(graph, str) and graph in text:
            text = text.replace(graph + "\n", "")  # printed once per wrapper it leaves
            log.debug("the failed export's partial graph:\n%s", graph)
        if text:
            sys.stderr.write(text)


def _run_device(model: nn.Module, args: tuple[Any, ...],
                kwargs: Mapping[str, Any]) -> torch.device | None:
    """The device a meta-built model's weights stand for: its inputs' (None when the model
    has no meta tensor or no real input)."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    inputs = [x for x in pytree.tree_leaves((args, dict(kwargs)))
              if isinstance(x, torch.Tensor) and not x.is_meta]
    return inputs[0].device if inputs else None


@contextmanager
def _meta_weights_on(device: torch.device | None) -> Iterator[None]:
    """Export a meta-built model as if its weights lived on ``device``: export's fake copies
    of the meta weights report that device, so the constants the forward makes on its
    weights' device (index tensors, a cache's empty tensors) are real tensors there, with
    their data, and never meta tensors without it."""
    if device is None:
        yield
        return
    from torch.export import _trace as export_trace

    fakify = getattr(export_trace, "_fakify_params_buffers", None)
    if fakify is None:  # a torch without the hook: constants made on meta stay there
        log.warning("export: torch %s has no _fakify_params_buffers; a meta-built model's "
                    "weights stay on meta during export", torch.__version__)
        yield
        return

    def on_device(fake_mode: Any, mod: nn.Module) -> dict[str, torch.Tensor]:
        fakes: dict[str, torch.Tensor] = fakify(fake_mode, mod)
        for fake in fakes.values():
            if fake.is_meta:
                fake.fake_device = device  # type: ignore[attr-defined]
        return fakes

    export_trace._fakify_params_buffers = on_device
    try:
        yield
    finally:
        export_trace._fakify_params_buffers = fakify


def _order_placeholders(graph: torch.fx.Graph, placeholders: Sequence[torch.fx.Node]) -> None:
    """Put the placeholders at the very top of the graph, in their original order."""
    anchor = next(iter(graph.nodes))
    for ph in reversed(placeholders):
        if ph is not anchor:
            anchor.prepend(ph)
        anchor = ph


def trace(model: nn.Module, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
          frontend: Frontend = "auto", leaf_modules: LeafSpec = (),
          share: ExportShare | None = None) -> torch.fx.GraphModule:
    """Capture ``model`` as a GraphModule carrying ``MODULE_PATH`` and ``PARAMS`` on every node.

    ``auto`` prefers fx without automatic leaves (they hide structure), then export.
    ``share``: the export runs through it (``passes.trace_share``: processes holding the
    same model export it once); with ``SMP_FX_EXPORT_CACHE`` set, the export is loaded
    from, or stored in, that directory (``passes.export_cache``)."""
    kwargs = dict(kwargs or {})
    args = tuple(args)
    if frontend not in ("auto", "fx", "export"):
        raise SMPTracingError.build("frontend must be 'auto', 'fx' or 'export'", frontend,
                                    fix="pick one of the three")
    leaf_modules = tuple(leaf_modules)
    start = time.perf_counter()
    errors: list[str] = []
    fx_gm: torch.fx.GraphModule | None = None
    fx_fail: _FxFailure | None = None
    if frontend in ("auto", "fx"):
        try:
            fx_gm, auto = _fx_trace(model, args, kwargs, leaf_modules, auto_leaf=True)
            fx_gm.meta["smp.auto_leaves"] = tuple(auto)
            if frontend == "fx" or not auto:
                return _finish(fx_gm, "fx", start)
            errors.append(f"fx: needed automatic leaves {auto}")
            log.info("auto: fx graph rejected (%s); trying torch.export", errors[-1])
        except _FxFailure as fail:
            fx_fail = fail
            errors.append(f"fx: module {fail.path!r}: {type(fail.exc).__name__}: {fail.exc}")
            log.info("auto: fx failed (%s); trying torch.export", errors[-1])
    if frontend in ("auto", "export"):
        try:
            def export() -> torch.fx.GraphModule:
                return _export_trace(model, args, kwargs, leaf_modules)

            export = export_cache.cached(export, model, args, kwargs)
            gm = export() if share is None else share.run(model, args, kwargs, export)
            return _finish(gm, "export", start)
        except SMPTracingError:
            raise
        except Exception as exc:
            errors.append(f"export: {one_line(exc)}")
            log.info("export failed: %s", errors[-1])
    if fx_gm is not None:
        log.info("auto: falling back to the fx graph with automatic leaves")
        return _finish(fx_gm, "fx", start)
    where = fx_fail.path if fx_fail and fx_fail.path else "<root>"
    mod_type = type(model.get_submodule(fx_fail.path)).__name__ if fx_fail and fx_fail.path \
        else type(model).__name__
    raise SMPTracingError.build(
        f"model cannot be captured by the {frontend!r} front end(s)", "; ".join(errors),
        f"module {where!r} ({mod_type})", _capture_fix(errors))


def _capture_fix(errors: Sequence[str]) -> str:
    """The fix for a model no front end captured, by what export said."""
    text = " ".join(errors)
    if "in output, which is not a known type" in text:
        return ("make forward return tensors (or tuples/dicts of them): export cannot return "
                "the object it names; for a Hugging Face model pass use_cache=False (the "
                "cache is such an object) or wrap it to return .logits")
    return ("make the failing submodule a leaf (leaf_modules=(...,)) so it runs as one opaque "
            "node, move data-dependent Python control flow out of forward, or partition "
            "manually with smp.partition")


def _finish(gm: torch.fx.GraphModule, frontend: str, start: float) -> torch.fx.GraphModule:
    _record_params(gm)
    gm.meta["smp.frontend"] = frontend
    gm.meta["smp.input_dims"] = input_dims_of(gm) if frontend == "export" else InputDims.free()
    gm.meta.setdefault("smp.auto_leaves", ())
    log.info("traced with %s in %.1f s: %d nodes; symbolic input dimensions: %s", frontend,
             time.perf_counter() - start, len(gm.graph.nodes),
             gm.meta["smp.input_dims"].free_words())
    return gm
