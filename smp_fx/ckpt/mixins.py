"""The SMP state-dict methods of ``DistributedModel`` and ``DistributedOptimizer``, as mixins.

What they read of the model comes from its ``checkpoint_view()`` (``smp_fx.ckpt.view``), so
this module imports neither class and reads no global. The optimizer's full order is
captured before narrowing, so a full state numbers as the plain optimizer's; states gather
over the pipeline group only, so calling them on ``dp_rank() == 0`` alone, as SMP says,
cannot hang.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

from cost_model.errors import SMPCheckpointError, not_implemented
from passes.tensor_parallel import merge_shards
from smp_fx.ckpt import sdp_shards, tp_shards
from smp_fx.ckpt.ep_shards import (
    expert_rows,
    gather_full,
    optimizer_rows,
)
from smp_fx.ckpt.snapshot import wait_copied
from smp_fx.ckpt.state_dict import (
    PARTIAL_KEY,
    check_model_keys,
    is_partial,
    local_model_state_dict,
    local_optimizer_state_dict,
    merge_model_state_dicts,
    merge_optimizer_state_dicts,
    merge_partial_optimizer_states,
    optimizer_state_by_name,
    optimizer_state_to_torch,
    select_model_state,
)
from smp_fx.ckpt.validate import agreed
from smp_fx.ckpt.view import CheckpointView, Ranks, ViewedModel
from smp_fx.world import comm
from smp_fx.world.context import ProcessModel, current_model

StateDict = dict[str, Any]


def _gather_pipeline(local: Any, ranks: Ranks) -> list[Any]:
    """Every pipeline stage's ``local`` (one process per stage), or ``[local]`` in-process;
    ``local``'s tensor-parallel shards are full tensors already."""
    return ranks.gather(comm.PP_GROUP)(local)


def _gather_tensor(spec: Any, t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The full tensor of this rank's shard ``t`` (collective over the tp group)."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(spec.parts)]
    dist.all_gather(parts, t, group=ranks.object_group("tp"))
    return merge_shards(spec, parts)


def gather_shards(view: CheckpointView, local: StateDict) -> StateDict:
    """``local`` with every tensor-parallel shard replaced by the full tensor (collective
    over the tp group): ``state_dict()`` is exactly the unsharded model's."""
    if view.tp_plan is None:
        return local
    out = dict(local)
    out.pop(tp_shards.TP_SHARDS_KEY, None)  # shards are full tensors below
    for spec in view.tp_plan.sharded:
        if spec.name in out:
            out[spec.name] = _gather_tensor(spec, out[spec.name], view.ranks)
    return out


def gather_optimizer_shards(view: CheckpointView | None, local: StateDict) -> StateDict:
    """A partial optimizer state with each tp-distributed parameter's tensor fields gathered
    over the tp group and merged like the parameter."""
    plan = None if view is None else view.tp_plan
    if view is None or plan is None or not plan.sharded:
        return local
    out = dict(local)
    out.pop(tp_shards.TP_SHARDS_KEY, None)
    entries = dict(out["state"])
    for spec in plan.sharded:
        entry = entries.get(spec.name)
        if isinstance(entry, Mapping):
            entries[spec.name] = {k: _gather_tensor(spec, v, view.ranks)
                                  if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                  for k, v in entry.items()}
    out["state"] = entries
    return out


def _with_shards(sd: StateDict, view: CheckpointView | None,
                 entries: Mapping[str, Any]) -> StateDict:
    """``sd`` saying which of its ``entries`` are this rank's tensor-parallel shards."""
    if view is None or view.tp_plan is None:
        return sd
    table = tp_shards.describe(view.tp_plan.sharded, view.tp_rank, entries)
    if table:
        sd[tp_shards.TP_SHARDS_KEY] = table
    return sd


def _refuse_foreign_shards(sd: Mapping[str, Any], view: CheckpointView,
                           names: list[str]) -> None:
    bad = sorted(set(tp_shards.foreign(sd, view.tp_plan, view.tp_rank)) & set(names))
    if bad:
        raise SMPCheckpointError.build(
            "the state holds tensor-parallel shards of another rank or degree", bad[:5],
            fix="load partial checkpoints with smp.load(f, partial=True) (or "
            "smp.resume_from_checkpoint), which re-cuts the shards for this layout")


def _shard_specs(view: CheckpointView | None) -> dict[str, Any]:
    """The tensor-parallel split of each distributed parameter, by name."""
    plan = None if view is None else view.tp_plan
    return {} if plan is None else {s.name: s for s in plan.sharded}


def _cut_shards(chosen: Mapping[str, Any], view: CheckpointView,
                shapes: Mapping[str, Any]) -> dict[str, Any]:
    """Full tensors of distributed parameters cut to this rank's shard (a full state dict,
    or a checkpoint saved at another tensor-parallel degree)."""
    specs = _shard_specs(view)
    return {n: tp_shards.cut(v, specs[n], view.tp_rank, tuple(shapes[n])) if n in specs
            else v for n, v in chosen.items()}


def _to_cpu(value: Any) -> Any:
    """Detached CPU copies, so gathered state pickles without devices or autograd."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        rebuild: Any = type(value)  # dict, OrderedDict, ...: the same kind of mapping back
        return rebuild((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _merged_partial(state_dict: Mapping[str, Any], ranks: Ranks) -> StateDict:
    """Every pipeline rank's partial state dict merged by name (still marked partial)."""
    # the pipeline group shares one tp rank: its shards are of one kind, merged by name
    parts = _gather_pipeline(_to_cpu(dict(state_dict)), ranks)
    if len(parts) == 1:
        return dict(state_dict)
    merged = merge_model_state_dicts(parts)
    merged[PARTIAL_KEY] = True
    return merged


class ModelCheckpointMixin:
    """``local_state_dict`` / ``state_dict`` / ``load_state_dict`` for DistributedModel."""

    _smp_pending_load: tuple[Mapping[str, Any], bool] | None = None
    """A load asked for before partitioning, applied right after it."""

    if TYPE_CHECKING:  # the host's (read-only on DistributedModel)

        def get_module(self) -> torch.nn.Module: ...

        @property
        def partitioned(self) -> bool: ...

        def local_unread_state(self) -> dict[str, torch.Tensor]: ...

        def checkpoint_view(self) -> CheckpointView: ...

    def _smp_local_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.local_named_parameters())  # type: ignore[attr-defined]
        tensors.update(self.local_named_buffers())  # type: ignore[attr-defined]
        tensors.update(self.local_unread_state())
        return tensors

    def local_state_dict(self) -> StateDict:
        """This rank's parameters and persistent buffers by FQN, with ``_smp_is_partial``.
        Expert slices are gathered whole (collective over the ep group at ep > 1)."""
        if not self.partitioned:
            raise SMPCheckpointError.build(
                "local_state_dict() needs the partitioned model", "partitioned=False",
                where="DistributedModel.local_state_dict",
                fix="call it after the first smp.step call, or use state_dict()")
        view = self.checkpoint_view()
        tensors = sdp_shards.whole(self._smp_local_tensors())  # sdp: whole tensors
        tensors = gather_full(tensors, view.experts)  # ep: every expert
        out = local_model_state_dict(tensors, view.layout)
        return _with_shards(out, view, out)

    def state_dict(self, *args: Any, gather_to_rank0: bool = False,
                   **kwargs: Any) -> StateDict:
        """The full model's state, exactly as the unwrapped model's ``state_dict()``; collective
            over the pipeline group (``gather_to_rank0``: only pipeline rank 0 holds it)."""
        if args or kwargs:
            raise SMPCheckpointError.build(
                "DistributedModel.state_dict() takes only gather_to_rank0", (args, kwargs),
                fix="call model.state_dict(); use local_state_dict() for this rank's part")
        if not self.partitioned:
            return self.get_module().state_dict()
        view = self.checkpoint_view()
        local = gather_shards(view, _to_cpu(self.local_state_dict()))
        parts = _gather_pipeline(local, view.ranks)
        if gather_to_rank0 and view.ranks.axis_rank("pp") != 0:
            return OrderedDict()
        return merge_model_state_dicts(parts, view.layout)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False, same_partition_load: bool = False) -> Any:
        """Load a full or partial state dict by name (before partitioning: right after it).

            A partial one is gathered over the pipeline group first (collective) unless
            ``same_partition_load``; values are copied, never assigned."""
        wait_copied()  # an asynchronous save's copy of the parameters is taken first
        if assign:
            raise not_implemented("load_state_dict(assign=True) on a DistributedModel",
                                  fix="use the default assign=False (values are copied)")
        if is_partial(state_dict) and not same_partition_load:
            state_dict = _merged_partial(state_dict, self.checkpoint_view().ranks)
        if not self.partitioned:
            pending = self._smp_pending_load
            self._smp_pending_load = (state_dict, strict)
            if pending is None:
                self.register_post_partition_hook(  # type: ignore[attr-defined]
                    lambda model: model._smp_apply_pending())
            return _IncompatibleKeys([], [])
        return self._smp_load_now(state_dict, strict)

    def _smp_apply_pending(self) -> None:
        pending, self._smp_pending_load = self._smp_pending_load, None
        if pending is not None:
            self._smp_load_now(*pending)

    def _smp_load_now(self, state_dict: Mapping[str, Any], strict: bool) -> Any:
        """Load on every rank, or fail on every rank (a state dict of another model fails
        on the ranks whose parameters it lacks: the others must not go on and wait)."""
        view = self.checkpoint_view()
        return agreed("DistributedModel.load_state_dict",
                      lambda: self._smp_load_local(state_dict, strict, view), view.ranks)

    def _smp_load_local(self, state_dict: Mapping[str, Any], strict: bool,
                        view: CheckpointView) -> Any:
        layout = view.layout
        partial = is_partial(state_dict)
        missing: list[str] = []
        unexpected: list[str] = []
        if not partial:
            missing, unexpected = check_model_keys(state_dict, layout)
        keys = set(layout.keys)  # persistent state only (non-persistent buffers excluded)
        local = {n: t for n, t in self._smp_local_tensors().items()
                 if any(a in keys for a in layout.names_of(n))}
        _refuse_foreign_shards(state_dict, view, list(local))
        chosen, local_missing = select_model_state(state_dict, list(local), layout)
        specs = _shard_specs(view)
        if partial:
            missing = local_missing
        if strict and (missing or unexpected):
            raise SMPCheckpointError.build(
                "state dict does not match the model (strict=True)",
                {"missing": missing[:10], "unexpected": unexpected[:10]},
                where="DistributedModel.load_state_dict",
                fix="load a state dict of this model, or pass strict=False")
        with torch.no_grad():
            for name in chosen:  # one tensor at a time (a lazily read state is read here)
                target = local[name]
                value = chosen[name]
                if name in specs:  # a full tensor of a distributed parameter: this rank's cut
                    value = tp_shards.cut(value, specs[name], view.tp_rank,
                                          tuple(target.shape))
                if name in view.experts:  # every expert: this rank's slice
                    value = expert_rows(value, tuple(target.shape))
                if tuple(target.shape) != tuple(value.shape):
                    raise SMPCheckpointError.build(
                        "shape of a loaded tensor differs from the model's",
                        (tuple(value.shape), tuple(target.shape)), where=name,
                        fix="load a checkpoint of the same model configuration")
                sdp_shards.assign(target, value)  # a sharded parameter takes its shard
        return _IncompatibleKeys(missing, unexpected)


class OptimizerCheckpointMixin:
    """``local_state_dict`` / ``state_dict`` / ``load_state_dict`` for DistributedOptimizer."""

    optimizer: torch.optim.Optimizer
    torch_optimizer: torch.optim.Optimizer
    """The torch optimizer whose state is checkpointed (``optimizer`` itself, or the one a
    script's own optimizer object holds; ``smp_fx.script_optimizer``)."""
    global_index: dict[int, int]
    checkpoint_ranks = Ranks()
    """Where this process is (the host sets it from the resolved configuration)."""
    _localized = False  # the host's: narrowed to this rank's parameters
    _smp_full_names: list[list[str | None]]
    _smp_pending_load: Mapping[str, Any] | None = None

    def __new__(cls, optimizer: torch.optim.Optimizer | None = None, *args: Any,
                **kwargs: Any) -> Any:
        self = super().__new__(cls)
        # None: copy/pickle re-creating the object; no param_groups: __init__ refuses it
        if optimizer is not None and hasattr(optimizer, "param_groups"):
            self._smp_full_names = _full_group_names(optimizer, cls._smp_current_model())
        return self

    def _smp_name_parameters(self, model: ProcessModel) -> None:
        """Name this optimizer's parameters by ``model``'s module (an optimizer built before
        its DistributedModel is named when the model adopts it)."""
        self._smp_full_names = _full_group_names(self.optimizer, model)

    @staticmethod
    def _smp_current_model() -> ViewedModel | None:
        """The DistributedModel this optimizer belongs to (the last one created)."""
        return cast("ViewedModel | None", current_model())

    def _smp_view(self) -> CheckpointView | None:
        """What checkpoints read of this optimizer's model (None: no model)."""
        model = self._smp_current_model()
        return None if model is None else model.checkpoint_view()

    def _smp_flat_names(self) -> list[str | None]:
        return [n for g in self._smp_full_names for n in g]

    def _smp_group_names(self, local: bool) -> list[list[str]]:
        full = self._smp_full_names
        names = full if not local else [
            [self._smp_flat_names()[self._smp_index(p)] for p in g["params"]]
            for g in self.torch_optimizer.param_groups]
        unnamed = [i for g in names for i, n in enumerate(g) if n is None]
        if unnamed:
            raise SMPCheckpointError.build(
                "optimizer parameters that are not parameters of the DistributedModel "
                "cannot be checkpointed by name", f"{len(unnamed)} parameter(s)",
                where="DistributedOptimizer",
                fix="create the model (smp.DistributedModel) before the optimizer, over its "
                "parameters")
        return cast(list[list[str]], names)

    def _smp_index(self, param: torch.Tensor) -> int:
        """``param``'s index in the optimizer's original flat parameter order."""
        return self.global_index[id(param)]

    def _smp_is_local(self) -> bool:
        return bool(self._localized)

    @property
    def shards_state(self) -> bool:
        """Whether this rank holds a ZeRO-1 shard of the optimizer's state (the host's)."""
        return False

    def local_state_dict(self, cast_to_cpu: bool = True,
                         gather_if_shard: bool = True) -> StateDict:
        """This rank's optimizer state keyed by FQN, with ``_smp_is_partial``; ``cast_to_cpu`` as
        SMP's default."""
        local = local_optimizer_state_dict(sdp_shards.whole(self.torch_optimizer.state_dict()),
                                           self._smp_group_names(local=True),
                                           self._smp_group_names(local=False))
        local = _with_shards(local, self._smp_view(), local["state"])
        return _to_cpu(local) if cast_to_cpu else local

    def state_dict(self) -> StateDict:
        """The full optimizer state, as the plain optimizer on the unwrapped model has it:
        tensor-parallel shards of the state gathered over the tp group and merged (padding
        dropped), then every pipeline stage's part merged. Collective over the tp and
        pipeline groups: call it on every rank with ``smp.dp_rank() == 0`` (or all)."""
        if not self._smp_is_local():
            return self.torch_optimizer.state_dict()
        local = gather_optimizer_shards(self._smp_view(), _to_cpu(self.local_state_dict()))
        return merge_optimizer_state_dicts(self._smp_gather_parts(local))

    def _smp_gather_parts(self, local: StateDict) -> list[Any]:
        """Every pipeline stage's partial state, its tp shards already gathered."""
        return _gather_pipeline(local, self.checkpoint_ranks)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load full (integer ids) or partial (FQN) state; deferred until partitioning."""
        wait_copied()  # an asynchronous save's copy of the state is taken first
        model = self._smp_current_model()
        if not self._smp_is_local() and model is not None and not model.partitioned:
            pending = self._smp_pending_load
            self._smp_pending_load = state_dict
            if pending is None:
                model.register_post_partition_hook(lambda m: self._smp_apply_pending())
            return
        self._smp_load_now(state_dict)

    def _smp_apply_pending(self) -> None:
        pending, self._smp_pending_load = self._smp_pending_load, None
        if pending is not None:
            self._smp_load_now(pending)

    def _smp_load_now(self, state_dict: Mapping[str, Any]) -> None:
        """Load on every rank, or fail on every rank (see the model's)."""
        if is_partial(state_dict) and self._smp_is_local():
            state_dict = self._smp_covering(state_dict)
        agreed("DistributedOptimizer.load_state_dict",
               lambda: self._smp_load_local(state_dict), self.checkpoint_ranks)

    def _smp_covering(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict``, this rank's part of a partial checkpoint, or every pipeline
        stage's part merged when some stage's part lacks a parameter that stage now holds:
        a checkpoint saved at these degrees on another cut (an automatic partition follows
        measured costs, so a restarted job may cut the same model otherwise). The model's
        partial state is always merged so (``_merged_partial``); the optimizer's, twice the
        bytes under Adam, only when the cut moved. Collective over the pipeline group."""
        saved = {n for g in state_dict.get("param_groups", ()) for n in g["params"]}
        held = {n for g in self._smp_group_names(local=True) for n in g}
        if not any(_gather_pipeline(bool(held - saved), self.checkpoint_ranks)):
            return state_dict
        return merge_partial_optimizer_states(
            _gather_pipeline(_to_cpu(dict(state_dict)), self.checkpoint_ranks))

    def _smp_load_local(self, state_dict: Mapping[str, Any]) -> None:
        if not self._smp_is_local() and not is_partial(state_dict):
            self.torch_optimizer.load_state_dict(dict(state_dict))  # the plain optimizer
            sdp_shards.reshard_optimizer_state(self.torch_optimizer)
            return
        by_name = (dict(state_dict) if is_partial(state_dict)
                   else optimizer_state_by_name(state_dict, self._smp_group_names(local=False)))
        local = self._smp_group_names(local=self._smp_is_local())
        view = self._smp_view()
        experts = frozenset() if view is None else view.experts
        if experts and self._smp_is_local():  # every expert's state: this rank's rows
            params = (p for g in self.torch_optimizer.param_groups for p in g["params"])
            shapes = {n: tuple(p.shape) for n, p in zip((n for g in local for n in g), params)
                      if n in experts}
            by_name["state"] = optimizer_rows(by_name["state"], shapes)
        if view is not None and _shard_specs(view):  # full tensors (a full state dict,
            names = [n for g in local for n in g]  # another degree) are cut to the shards
            if is_partial(by_name):
                _refuse_foreign_shards(by_name, view, names)
            params = (p for g in self.torch_optimizer.param_groups for p in g["params"])
            shapes = {n: p.shape for n, p in zip(names, params)}
            by_name["state"] = {**by_name["state"], **_cut_shards(
                {n: v for n, v in by_name["state"].items() if n in shapes}, view, shapes)}
        self.torch_optimizer.load_state_dict(optimizer_state_to_torch(by_name, local,
                                                                require_complete=True))
        sdp_shards.reshard_optimizer_state(self.torch_optimizer)  # sdp: whole -> shards


def _full_group_names(optimizer: torch.optim.Optimizer,
                      model: ProcessModel | None) -> list[list[str | None]]:
    """FQN of every parameter of ``optimizer`` in group order (None where it has none)."""
    names: dict[int, str] = {}
    if model is not None:
        names = {id(p): n for n, p in model.get_module().named_parameters()}
    return [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
