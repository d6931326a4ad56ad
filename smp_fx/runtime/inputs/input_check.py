"""A step's inputs come from the first pipeline rank; other pipeline ranks may pass
placeholders, and real data they pass must be the first rank's. The ranks of a
context-parallel group (and of a tensor-parallel group with ``prescaled_batch``) must be
given the same batch, those of a tensor-parallel group without it batches of one shape.

See docs/runtime.md, 'A step's inputs'.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPRuntimeError
from smp_fx.world import comm, state

Path = tuple[Any, ...]
"""Where a value sits among a step's arguments: the argument (position or name), then the
keys / indices into its containers."""


def _leaves(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[Path, Any]]:
    """Every tensor and ``None`` among the arguments, nested ones too, with its path."""
    out: list[tuple[Path, Any]] = []

    def visit(value: Any, path: Path) -> None:
        if value is None or isinstance(value, torch.Tensor):
            out.append((path, value))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, (*path, i))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, (*path, key))

    for i, arg in enumerate(args):
        visit(arg, (i,))
    for name, arg in kwargs.items():
        visit(arg, (name,))
    return out


def words(path: Path) -> str:
    """``argument 1``, ``argument 'batch'['labels'][0]``: a path as the errors say it."""
    head, rest = path[0], path[1:]
    return f"argument {head!r}" + "".join(f"[{k!r}]" for k in rest)


def _is_placeholder(value: Any) -> bool:
    return value is None or (isinstance(value, torch.Tensor) and value.numel() == 0)


def fingerprint(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """(where, shape, dtype, sum, sum of squares, sum weighted by position) of every tensor
    argument, nested ones too; the sums as ``float.hex`` strings, exact and NaN-safe."""
    out: list[tuple[Any, ...]] = []
    for path, value in _leaves(args, kwargs):
        if value is None:
            continue
        v = value.detach().to(torch.float64).flatten()
        at = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device)
        sums = (v.sum(), (v * v).sum(), (v * at).sum())
        out.append((words(path), tuple(value.shape), str(value.dtype),
                    *(float(x).hex() for x in sums)))  # hex: NaN equals NaN
    return out


class _Agreement:
    """What the first call of one step function settled: the paths at which some rank
    passes placeholders (empty: nothing travels on later calls), and where this rank
    passed real data."""

    def __init__(self, model: Any, paths: frozenset[Path], real: frozenset[Path]) -> None:
        self.model = weakref.ref(model)
        self.paths = paths
        self.real = real


_agreed: weakref.WeakKeyDictionary[Callable[..., Any], _Agreement] = \
    weakref.WeakKeyDictionary()


def first_rank_inputs(model: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any], st: state.State
                      ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """This call's arguments with the placeholders replaced by the first pipeline rank's
    (module docstring); the first call of ``fn`` for ``model`` also checks that the real
    data agrees. A collective over the pipeline group, on every rank; nothing to do in one
    process (``st``: what ``smp.init`` established)."""
    if st.in_process or len(st.group_ranks(comm.PP_GROUP.axis)) < 2:
        return args, kwargs
    where = getattr(fn, "__name__", "smp.step function")
    agreed = _agreed.get(fn)
    if agreed is None or agreed.model() is not model:
        agreed = _agree(model, args, kwargs, where, st.group_ranks(comm.PP_GROUP.axis))
        _agreed[fn] = agreed
    if not agreed.paths:
        _no_new_placeholders(agreed, args, kwargs, where, st.rank)
        return args, kwargs
    return _fetch(agreed.paths, args, kwargs, where, st)


def _no_new_placeholders(agreed: _Agreement, args: tuple[Any, ...],
                         kwargs: Mapping[str, Any], where: str, rank: int) -> None:
    """Without an exchange (no placeholders at the first call), a placeholder where this
    rank passed real data then is this rank's error; its peers stop on its failure."""
    for path, value in _leaves(args, kwargs):
        if path in agreed.real and _is_placeholder(value):
            raise _stray(path, rank, where)


def _stray(path: Path, rank: int, where: str) -> SMPRuntimeError:
    return SMPRuntimeError.build(
        "a placeholder where the first call of this step function had real data",
        {"where": words(path), "rank": rank}, where,
        "pass placeholders in the same arguments on every call of a step function")


def _agree(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
           where: str, ranks: list[int]) -> _Agreement:
    leaves = _leaves(args, kwargs)
    mine = {"paths": [p for p, _ in leaves],
            "placeholders": [p for p, v in leaves if _is_placeholder(v)],
            "prints": fingerprint(args, kwargs)}
    everyone = comm.allgather(mine, comm.PP_GROUP)
    first = everyone[0]
    first_real = set(first["paths"]) - set(first["placeholders"])
    paths: set[Path] = set()
    for i, other in enumerate(everyone[1:], start=1):
        placeholders = set(other["placeholders"]) & first_real
        _same_structure(first, other, placeholders, ranks[i], where)
        skip = {words(p) for p in placeholders}
        theirs = [f for f in other["prints"] if f[0] not in skip]
        ours = [f for f in first["prints"] if f[0] not in skip]
        if theirs != ours:
            differs = next((a[0] for a, b in zip(ours, theirs) if a != b),
                           "the number of tensor arguments")
            raise SMPRuntimeError.build(
                "every rank of a pipeline group must be given the same batch",
                {"differs": differs, "ranks": [ranks[0], ranks[i]]}, where,
                "shard the data by smp.dp_rank() / smp.dp_size(), not by the global rank, "
                "or pass placeholders (empty tensors) on the pipeline ranks after the first "
                "(the Hugging Face Trainer: run it with the smdistributed shims, see "
                "docs/clients.md)")
        paths |= placeholders
    real = frozenset(p for p, v in leaves if not _is_placeholder(v))
    return _Agreement(model, frozenset(paths), real)


def _same_structure(first: Mapping[str, Any], other: Mapping[str, Any],
                    placeholders: set[Path], rank: int, where: str) -> None:
    """Placeholders stand in for arguments the first rank passes, at the same places."""
    if set(first["paths"]) == set(other["paths"]):
        return
    extra = sorted(map(words, set(other["paths"]) ^ set(first["paths"])))
    raise SMPRuntimeError.build(
        "a pipeline rank's step arguments must have the first rank's structure",
        {"differs": extra[:3], "rank": rank, "placeholders": len(placeholders)}, where,
        "pass the same arguments on every pipeline rank (placeholders: empty tensors in "
        "the places of the first rank's tensors)")


def _fetch(paths: frozenset[Path], args: tuple[Any, ...], kwargs: dict[str, Any],
           where: str, st: state.State) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first rank's tensors at ``paths``, put in place of this rank's."""
    first = st.axis_rank("pp") == 0
    leaves = dict(_leaves(args, kwargs))
    mine = {p: leaves.get(p) for p in paths} if first else \
        sorted((p for p, v in leaves.items() if _is_placeholder(v) and p not in paths),
               key=repr)
    everyone = comm.allgather(mine, comm.PP_GROUP)
    stray = [(i, p) for i, extra in enumerate(everyone[1:], start=1) for p in extra]
    if stray:  # every rank sees it: all raise together
        ranks = st.group_ranks(comm.PP_GROUP.axis)
        raise _stray(stray[0][1], ranks[stray[0][0]], where)
    if first:
        return args, kwargs
    values: dict[Path, Any] = everyone[0]
    device = next((v.device for v in leaves.values() if isinstance(v, torch.Tensor)), None)
    return _replace(args, kwargs, values, device)


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], values: Mapping[Path, Any],
             device: torch.device | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def rebuild(value: Any, path: Path) -> Any:
        if path in values:
            got = values[path]
            return got.to(device) if isinstance(got, torch.Tensor) and device else got
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Tensor):
            items = [rebuild(v, (*path, i)) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, Mapping):
            rebuilt = {k: rebuild(v, (*path, k)) for k, v in value.items()}
            return rebuilt if type(value) is dict else type(value)(rebuilt)  # type: ignore[call-arg]
        return value

    return (tuple(rebuild(a, (i,)) for i, a in enumerate(args)),
            {k: rebuild(v, (k,)) for k, v in kwargs.items()})


_SHARED_BATCH = {
    "cp": "every rank of a context-parallel group must be given the same batch (each takes "
          "its chunks of the sequence)",
    "tp": "with prescaled_batch true the ranks of a tensor-parallel group must be given the "
          "same batch (each takes its slice of it)"}
_SAME_SHAPES = ("with prescaled_batch false the ranks of a tensor-parallel group must be "
                "given batches of the same shapes (a marked module concatenates them)")
_checked: weakref.WeakKeyDictionary[Callable[..., Any], Any] = weakref.WeakKeyDictionary()
"""Per step function: the model whose first call compared the shared batches' data."""


def batch_agrees_over_groups(model: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                             kwargs: Mapping[str, Any], st: state.State) -> None:
    """The groups that split or concatenate a batch are given batches that fit: the same
    batch on the ranks of a context-parallel group, and of a tensor-parallel group with
    ``prescaled_batch`` (its data compared at the first call of ``fn``: a loader sharded
    by the global rank gives them different examples, which train without an error, on a
    mix of sequences), and batches of the same shapes on every such group, tp without
    ``prescaled_batch`` too (compared at every call: a dynamically padded batch of another
    length on one rank would abort gloo's collective, or hang NCCL's, inside the model).
    Every call exchanges one digest over each group's gloo group, of the fingerprints at
    the first call where they are compared, else of the shapes (a median 0.26 ms a call on
    2 CPU processes); where anything differs, every rank of the group raises the same
    error."""
    if st.in_process:
        return
    shared = [axis for axis in ("cp", "tp") if len(st.group_ranks(axis)) > 1
              and (axis == "cp" or st.config.prescaled_batch)]
    shaped = shared + ["tp"] * (len(st.group_ranks("tp")) > 1 and not st.config.prescaled_batch)
    if not shaped:
        return
    where = getattr(fn, "__name__", "smp.step function")
    first = bool(shared) and _checked.get(fn) is not model
    shapes = [(words(p), tuple(v.shape)) for p, v in _leaves(args, kwargs)
              if isinstance(v, torch.Tensor)]
    for axis in shaped:
        if not (first and axis in shared):  # there the fingerprints carry the shapes
            _same_over(axis, shapes, _SHARED_BATCH[axis] if axis in shared else _SAME_SHAPES,
                       where, st)
    if first:
        prints = fingerprint(args, kwargs)
        for axis in shared:
            _same_over(axis, prints, _SHARED_BATCH[axis], where, st)
        _checked[fn] = model


_all_gather_into: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch 2.13 renamed ``all_gather_into_tensor`` (now deprecated, a FutureWarning on every
rank) ``all_gather_single``."""


def _same_over(axis: str, mine: list[tuple[Any, ...]], rule: str, where: str,
               st: state.State) -> None:
    """Raise ``rule`` on every rank of ``axis``'s group unless all hold ``mine`` alike (a
    digest compared first; the values exchanged only to say what differs)."""
    digest = torch.tensor([zlib.crc32(repr(mine).encode())], dtype=torch.int64)
    ranks, pg = st.group_ranks(axis), st.object_group(axis)
    got = torch.empty(len(ranks), dtype=torch.int64)
    what = f"the {axis} group's batches"
    comm._bounded(what, lambda: _all_gather_into(got, digest, group=pg))
    if bool((got == digest).all()):
        return
    everyone: list[Any] = [None] * len(ranks)
    comm._bounded(what, lambda: dist.all_gather_object(everyone, mine, group=pg))
    i = next(i for i, other in enumerate(everyone) if other != everyone[0])
    differs: Any = next(((a, b) for a, b in zip(everyone[0], everyone[i]) if a != b),
                        (len(everyone[0]), len(everyone[i])))
    if isinstance(differs[0], tuple) and differs[0][:3] == differs[1][:3]:
        differs = f"{differs[0][0]}: the same shape, other values"
    fix = ("pad every batch to one length (padding='max_length' in the tokenizer), or set "
           "prescaled_batch: true and give the tensor-parallel ranks the same batch"
           if rule == _SAME_SHAPES else
           "shard the data by smp.rdp_rank() / smp.rdp_size(), not by the global rank")
    raise SMPRuntimeError.build(rule, {"ranks": [ranks[0], ranks[i]], "differs": differs},
                                where, f"{fix} (docs/runtime.md, 'A step's inputs')")


__all__ = ["batch_agrees_over_groups", "fingerprint", "first_rank_inputs", "words"]
