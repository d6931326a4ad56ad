"""Where the sequence is in a traced graph's values: the symbol of its length, and the
dims of a value that have it (``torch.export`` keeps the length symbolic, so a dim is the
sequence when its size is that symbol, or an expression equal to it over its range)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from cost_model.errors import SMPPassError

aten = torch.ops.aten
SDPA = (aten.scaled_dot_product_attention.default,
        torch.nn.functional.scaled_dot_product_attention)


def val_of(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def is_tensor(node: Any) -> bool:
    return isinstance(val_of(node), torch.Tensor)


def is_data(node: Any) -> bool:
    """A tensor, or a tuple of them (an op with several outputs, read by getitem)."""
    val = val_of(node)
    return isinstance(val, torch.Tensor) or isinstance(val, (tuple, list)) and any(
        isinstance(v, torch.Tensor) for v in val)


def is_symint(node: Any) -> bool:
    return isinstance(val_of(node), torch.SymInt)


def expr_of(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else None


def _is_seq(size: Any, seq: Any) -> bool:
    """Whether ``size`` is the sequence length wherever the trace allows it: the symbol,
    or an expression of it equal to it over its range (``Min(256, s)`` when s <= 256)."""
    expr = expr_of(size)
    if expr is None or expr.free_symbols != {seq}:
        return False
    if expr == seq:
        return True
    bounds = size.node.shape_env.var_to_range.get(seq)
    if bounds is None:
        return False
    lower = max(_finite(bounds.lower) or 2, 2)
    upper = _finite(bounds.upper)
    samples = {lower, lower + 1} | ({upper} if upper is not None else set())
    return all(expr.subs(seq, v) == v for v in samples)


def _finite(bound: Any) -> int | None:
    """An integer bound of a symbol's range; None when unbounded."""
    try:
        value = int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return value if abs(value) < 2**62 else None


def seq_dims(node: Any, seq: Any) -> tuple[int, ...]:
    """Dims of ``node``'s tensor whose size is the sequence length."""
    val = val_of(node)
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(i for i, s in enumerate(val.shape) if _is_seq(s, seq))


def mentions(node: Any, seq: Any) -> bool:
    """Whether any size of ``node``'s value (or the value, a SymInt) involves the sequence."""
    val = val_of(node)
    sizes = val.shape if isinstance(val, torch.Tensor) else (val,)
    return any(isinstance(s, torch.SymInt) and seq in s.node.expr.free_symbols for s in sizes)


def sequence_symbol(gm: torch.fx.GraphModule) -> Any:
    """The symbol of dim 1 of the first input; refused when the graph fixed it."""
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    val = val_of(first)
    if first is None or not isinstance(val, torch.Tensor) or val.dim() < 2 \
            or expr_of(val.shape[1]) is None or not expr_of(val.shape[1]).is_Symbol:
        raise SMPPassError.build(
            "context parallelism splits dim 1 of the model's first input, which must be a "
            "symbolic sequence length in the traced graph", None if first is None else
            first.name, "passes.context_parallel",
            "pass (batch, sequence, ...) inputs first, to a model torch.export traces "
            "(Hugging Face models are)")
    return expr_of(val.shape[1])


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Data inputs of ``node`` (an SDPA's mask excluded: it may stay whole)."""
    ins = [a for a in node.all_input_nodes if is_data(a)]
    if node.target in SDPA:
        ins = [a for a in ins if a in (node.args[:3])]
    return ins


def name_of(target: Any) -> str:
    return str(getattr(target, "__name__", target))



__all__ = ["SDPA", "expr_of", "is_data", "is_symint", "is_tensor", "mentions", "name_of",
           "seq_dims", "sequence_symbol", "tensor_inputs", "val_of"]
