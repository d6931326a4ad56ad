"""Shape propagation on fake tensors: shape, dtype and bytes of every value, no real memory.

Like torch's ``ShapeProp`` but under ``FakeTensorMode``, so a meta-device GPT-2-XL is
propagated without allocating; the module is never mutated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from cost_model.errors import SMPTracingError
from passes.meta import TENSOR

log = logging.getLogger("smp_fx.passes.shape_prop")


@dataclass(frozen=True)
class TensorInfo:
    """Static facts about one tensor value: enough to cost memory and communication."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    contiguous: bool = True
    """Row-major memory layout; tells the cost model when a reshape/matmul must copy."""

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        shape = tuple(int(s) for s in t.shape)
        numel = 1
        for s in shape:
            numel *= s
        return cls(shape, str(t.dtype).removeprefix("torch."), numel * t.element_size(),
                   bool(t.is_contiguous()))

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "nbytes": self.nbytes,
                "contiguous": self.contiguous}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorInfo:
        return cls(tuple(data["shape"]), data["dtype"], int(data["nbytes"]),
                   bool(data.get("contiguous", True)))


ValueInfo = Any
"""``TensorInfo``, a tuple of ``ValueInfo`` for tuple/list outputs, or ``None``."""


def value_info(value: Any) -> ValueInfo:
    """``TensorInfo`` for tensors, tuples of them for sequences holding tensors, ``None``
    for everything else (sizes, ints, tensor-free tuples)."""
    if isinstance(value, torch.Tensor):
        return TensorInfo.of(value)
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        infos = tuple(value_info(v) for v in value)
        return infos if any(i is not None for i in infos) else None
    return None


def total_nbytes(info: ValueInfo) -> int:
    """Bytes of every tensor in a (possibly nested) ``ValueInfo``."""
    if isinstance(info, TensorInfo):
        return info.nbytes
    if isinstance(info, tuple):
        return sum(total_nbytes(i) for i in info)
    return 0


_DEVICE_WORDS = ("device mismatch", "on the same device", "expected device", "meta device",
                 "devices")
_DATA_WORDS = ("data-dependent", "data dependent", "DataDependent", "nonzero", ".item()",
               "GuardOnDataDependentSymNode", "dynamic output shape")


def diagnose(exc: BaseException) -> tuple[str, str]:
    """The rule and the fix for an op that failed on fake tensors: mixed devices get their own
    message; making a module a leaf fixes only data-dependent operations."""
    text = f"{type(exc).__name__}: {exc}"
    if any(w.lower() in text.lower() for w in _DEVICE_WORDS):
        return ("shape propagation found tensors on different devices (parameters, "
                "buffers, example inputs or tensors the forward creates)",
                "put the example inputs on the device the model's weights are on (meta "
                "weights stand for the inputs' device; a tensor the forward creates on a "
                "fixed device must follow its inputs: device=x.device), or build the model "
                "under smp.delay_param_initialization()")
    if any(w.lower() in text.lower() for w in _DATA_WORDS):
        return ("shape propagation on fake tensors failed on a data-dependent operation",
                "make the module a leaf (its output shape is then measured), or remove "
                "data-dependent operations (.item(), nonzero, Python branches on tensor "
                "values) from forward")
    return ("shape propagation on fake tensors failed",
            "check the example inputs' shapes and dtypes against what forward expects; if "
            "the failing operation is data-dependent, make its module a leaf")


class _FakeProp(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, state: dict[str, torch.Tensor]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.state = state
        self.infos: dict[str, ValueInfo] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:
            rule, fix = diagnose(exc)
            raise SMPTracingError.build(
                rule, f"{type(exc).__name__}: {exc}",
                f"node={n.format_node()} (module {n.meta.get('smp.module_path', '?')!r})",
                fix) from exc
        self.infos[n.name] = value_info(result)
        return result

    def fetch_attr(self, target: str) -> Any:
        if target in self.state:
            return self.state[target]
        return super().fetch_attr(target)

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.state:
            return super().call_module(target, args, kwargs)
        submod = self.module.get_submodule(target)
        prefix = f"{target}."
        sub_state = {k[len(prefix):]: v for k, v in self.state.items() if k.startswith(prefix)}
        return torch.func.functional_call(submod, sub_state, args, kwargs, strict=False)


def _fake_state(gm: torch.nn.Module, mode: FakeTensorMode,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Fake copies of all parameters and buffers, tied ones staying tied (same object)."""
    memo: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    named: list[tuple[str, torch.Tensor]] = [*gm.named_parameters(remove_duplicate=False),
                                             *gm.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) not in memo:
            memo[id(t)] = _fake(t, mode, device)
        out[name] = memo[id(t)]
    return out


def _fake(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    """A fake tensor like ``t``; meta tensors become fake tensors on ``device``."""
    if t.device.type == "meta":
        with mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    else:
        fake = mode.from_tensor(t)
    if isinstance(t, torch.nn.Parameter):
        fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
    elif t.requires_grad:
        fake.requires_grad_(True)
    return fake


def shape_prop(gm: torch.fx.GraphModule, args: tuple[Any, ...] = (),
               kwargs: dict[str, Any] | None = None, device: str | torch.device = "cpu",
               allow_real_run: bool = True) -> torch.fx.GraphModule:
    """Return a copy of ``gm`` with ``TENSOR`` set on every node; ``gm`` is not mutated.

    A leaf with data-dependent control flow gets one real no-grad forward when allowed
    and every weight is real, as SMP's tracing step; else ``SMPTracingError``."""
    from passes.graph_utils import copy_graph_module

    device = torch.device(device)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = _fake_state(gm, mode, device)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    fake_leaves = [_fake(x, mode, device) if isinstance(x, torch.Tensor) else x for x in leaves]
    fargs, fkwargs = pytree.tree_unflatten(fake_leaves, spec)
    prop = _FakeProp(gm, state)
    try:
        with mode:
            prop.run(*_flatten_inputs(gm, fargs, fkwargs))
    except SMPTracingError:
        tensors = [*gm.parameters(), *gm.buffers()]
        tensors += [x for x in leaves if isinstance(x, torch.Tensor)]
        if not allow_real_run or any(t.is_meta for t in tensors):
            raise
        log.info("shape_prop: fake tensors failed; measuring shapes with one real forward")
        prop = _FakeProp(gm, {})
        with torch.no_grad():
            prop.run(*_flatten_inputs(gm, tuple(args), dict(kwargs or {})))
    out = copy_graph_module(gm)
    for node in out.graph.nodes:
        TENSOR.set(node, prop.infos.get(node.name))
    return out


def _flatten_inputs(gm: torch.fx.GraphModule, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> list[Any]:
    """Map (args, kwargs) onto the graph's placeholders (pytree codegen for export graphs)."""
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), info.in_spec))
    names = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for ph in names[len(values):]:
        if ph.target in kwargs:
            values.append(kwargs[ph.target])
        elif ph.args:
            values.append(ph.args[0])  # default value of the forward argument
        else:
            raise SMPTracingError.build("missing input for placeholder", ph.target,
                                        "shape_prop", "pass it in args or kwargs")
    return values


__all__ = ["TensorInfo", "shape_prop", "total_nbytes", "value_info"]
