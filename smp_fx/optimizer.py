"""``smp.DistributedOptimizer``: any torch optimizer, stepping only this rank's parameters.

Built over the full model before partitioning and narrowed in place when the model binds
it (parameters matched by identity, then name, so re-created ones map too); it stays a
``torch.optim.Optimizer`` so LR schedulers accept it. fp16 masters, ZeRO-1 and sdp
clipping: docs/precision.md.

>>> import torch
>>> opt = DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
>>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
>>> opt.step(); sched.step(); opt.param_groups[0]["lr"]
0.05
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from cost_model.errors import SMPRuntimeError
from smp_fx.amp.fp16 import MasterWeights
from smp_fx.amp.loss_scaler import LossScaler, make_scaler
from smp_fx.ckpt import checkpoint_api
from smp_fx.ckpt.ep_shards import gather_optimizer_full
from smp_fx.ckpt.mixins import OptimizerCheckpointMixin, StateDict
from smp_fx.ckpt.state_dict import merge_partial_optimizer_states
from smp_fx.ckpt.view import Ranks
from smp_fx.nn.huggingface.registry import follow_replacements
from smp_fx.optimizer_compat import ClientViews
from smp_fx.parallel import clip, ds_view
from smp_fx.parallel.build import OptimizerBinding
from smp_fx.parallel.ddp import guard_optimizer
from smp_fx.parallel.zero import OptimizerShards
from smp_fx.runtime.executor.lowering import Op, trains
from smp_fx.script_optimizer import is_script_optimizer, model_param_ids, torch_optimizer
from smp_fx.world import comm, context, state
from smp_fx.world.context import current_model

if TYPE_CHECKING:
    from smp_fx.model import DistributedModel

log = logging.getLogger("smp_fx.optimizer")

MASTER_KEY = "fp32_master"
"""Per-parameter optimizer state entry holding its fp32 master weight (fp16 training)."""
SCALER_KEY = "loss_scaler"
"""Param-group entry holding the loss scaler's state in a saved fp16 optimizer state."""


class DistributedOptimizer(OptimizerCheckpointMixin, ClientViews, torch.optim.Optimizer):
    """See the module docstring."""

    # torch.amp.GradScaler must unscale (and agree on infs) before calling step()
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> None:
        self.checkpoint_ranks = Ranks.current()  # as smp.init resolved it (smp_fx.ckpt.view)
        self.torch_optimizer = torch_optimizer(optimizer)  # a script's object: its optimizer
        self._script = is_script_optimizer(optimizer)  # (smp_fx.script_optimizer)
        cfg = state.get().config if state.is_initialized() else None
        if cfg is not None:  # a configured feature smp-fx lacks: an error, never ignored
            cfg.check_features("DistributedOptimizer")
        nested = dynamic_loss_args.pop("dynamic_loss_args", None)  # SMP scripts pass a dict
        if isinstance(nested, Mapping):
            dynamic_loss_args = {**nested, **dynamic_loss_args}
        self.fp16 = bool(cfg is not None and (cfg.fp16 or cfg.bf16))  # fp32 masters
        if cfg is not None and cfg.bf16:  # bf16 has fp32's range: SMP does not scale it
            static_loss_scale, dynamic_loss_scale, dynamic_loss_args = 1.0, False, {}
        scaler = make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        if not self.fp16 and (dynamic_loss_scale or static_loss_scale not in (None, 1.0)):
            log.info("smp-fx: loss-scaling arguments apply with 'fp16': true only; unused")
        self._scaler: LossScaler = scaler
        self._masters: MasterWeights | None = None
        self._shards: OptimizerShards | None = None
        self._local_params: list[torch.Tensor] = []
        self._model_ref: weakref.ref[DistributedModel] | None = None
        self._overflow = False
        self._global_grad_norm: float | None = None  # the last step's, with sdp (SMP's name)
        self.optimizer = optimizer
        # optimizer.step() inside smp.step raises (smp_fx.parallel.ddp)
        guard_optimizer(self.torch_optimizer)
        self._make_torch_hook_tables()
        self.global_index: dict[int, int] = {}
        flat = self.parameters_held()
        self._localized = False
        self._names: dict[int, str] = {}
        self._local_params = flat  # until a model's partitioning narrows them
        context.set_current_optimizer(self)
        model = current_model()
        if model is not None and model.owns_parameters(flat):
            self.join_model(cast("DistributedModel", model))  # the one model kind there is
        else:  # a DistributedModel created later adopts it; over other parameters: left whole
            context.wait_for_model(self)

    def _make_torch_hook_tables(self) -> None:
        """The hook tables ``torch.optim.Optimizer.__init__`` makes, which this wrapper (its
        groups and state are the wrapped optimizer's, so it does not call that) still needs
        for ``register_step_pre_hook`` and the state-dict hooks."""
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._zero_grad_profile_name = "Optimizer.zero_grad"

    @property
    def overflow(self) -> bool:
        """Whether the last step overflowed (fp16): a script's own optimizer's flag."""
        own: Any = self.optimizer  # a script's object: its own attributes
        return bool(own.overflow) if self._script else self._overflow

    def parameters_held(self) -> list[torch.Tensor]:
        """Every parameter of the wrapped optimizer, in group order; one of a module the wrapping
        replaced stands for the replacement's, so an optimizer made first trains what the
        model trains."""
        if follow_replacements(self.torch_optimizer) or not self.global_index:
            flat = [p for g in self.torch_optimizer.param_groups for p in g["params"]]
            self.global_index = {id(p): i for i, p in enumerate(flat)}
        return [p for g in self.torch_optimizer.param_groups for p in g["params"]]

    def join_model(self, model: DistributedModel) -> None:
        """Belong to ``model`` (a DistributedModel holding this optimizer's parameters):
        parameters are named by its module's names and narrowed at its partitioning."""
        context.stop_waiting(self)
        self._names = {id(p): n for n, p in model.get_module().named_parameters()}
        self._model_ref = weakref.ref(model)
        self._smp_name_parameters(model)
        model.attach_optimizer(self)
        checkpoint_api.adopt_pending(optimizer=self)

    # the wrapped optimizer's containers are this optimizer's
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.torch_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.torch_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.torch_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.torch_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.torch_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.torch_optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    # ---- stepping ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The loss scale ``model.backward`` multiplies the loss by (1.0 without fp16)."""
        if self._script:
            return float(getattr(self.optimizer, "loss_scale", 1.0))
        return self._scaler.loss_scale if self._masters is not None else 1.0

    def step(self, closure: Any = None) -> Any:
        """Step this rank's parameters (fp16: every rank skips on any overflow; ZeRO-1: owners
        broadcast, a collective over the rdp group)."""
        masters = self._masters
        if masters is not None:
            self._overflow = masters.prepare()
            self._scaler.update_scale(self._overflow)
            if self._overflow:
                log.info("smp-fx fp16: gradient overflow, step skipped; loss scale now %g",
                         self._scaler.loss_scale)
                return None
        self._clip_for_sdp()
        out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if masters is not None:
            masters.masters_to_model()
        if self._shards is not None:
            self._shards.broadcast()
        return out

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip what the optimizer steps by the whole model's norm and return it (-1 on an fp16
        overflow), as Megatron's ``FP16_Optimizer``; a collective on every rank."""
        if self._script:
            own: Any = self.optimizer
            return cast(torch.Tensor, own.clip_master_grads(max_norm, norm_type))
        model = self._model()
        if self._masters is None:
            if model is None:
                params = [p for g in self.param_groups for p in g["params"]]
                return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            return clip.clip_grad_norm_(_norm_scope(), model, max_norm, norm_type)
        if self._masters.prepare():
            return torch.tensor(-1.0)
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        counted, extra = self._norm_terms(params)
        return clip.clip_grads(_norm_scope(), grads, counted, max_norm, norm_type,
                               extra_groups=extra)

    def global_grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole model's gradients from ``params`` (masters, or this rank's
        shard); what a wrapped ``FusedLamb`` clips by. A collective."""
        counted, extra = self._norm_terms(params)
        return clip.global_norm(_norm_scope(), counted, 2.0, extra)

    def _norm_terms(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """(gradients this rank counts, groups to sum over besides model-parallel): replicas once,
        by the model parameter behind each master."""
        model = self._model()
        if model is None:
            return [p.grad for p in params if p.grad is not None], []
        model_of = self._masters.model_of if self._masters is not None else {}
        behind = [model_of.get(id(p), p) for p in params]
        _, chosen = clip.counted_parameters(_norm_scope(), model, behind)
        ids = {id(q) for q in chosen}
        counted = [p.grad for p, q in zip(params, behind)
                   if p.grad is not None and id(q) in ids]
        return counted, [self._shards.group] if self._shards is not None else []

    def _clip_for_sdp(self) -> None:
        """Sharded data parallelism clips the global norm every step, as SMP does, keeping the
        unclipped norm in ``_global_grad_norm`` for AWS's ``train.py`` logs."""
        model = self._model()
        if model is None or not state.is_initialized():
            return
        st = state.get()
        cfg = st.config
        if cfg.sharded_data_parallel_degree > 1:
            limit = cfg.sdp_gradient_clipping if cfg.sdp_gradient_clipping > 0 else math.inf
            scope = clip.NormScope.of(st)
            if self._masters is None:
                self._global_grad_norm = float(clip.clip_grad_norm_(scope, model, limit))
                return
            # bf16: the fp32 master gradients are what the step uses
            params = [p for g in self.param_groups for p in g["params"]]
            counted, extra = self._norm_terms(params)
            grads = [p.grad for p in params if p.grad is not None]
            self._global_grad_norm = float(clip.clip_grads(scope, grads, counted, limit,
                                                           extra_groups=extra))

    def zero_grad(self, set_to_none: bool = True, **kwargs: Any) -> None:
        """Clear every local parameter's gradient (others' ZeRO-1 shards too) and the masters'; a
        script's own optimizer object clears with its own arguments."""
        if self._script:
            self.optimizer.zero_grad(**kwargs)
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)
        _zero_grads(self._local_params, set_to_none)
        if self._masters is not None:
            self._masters.zero_grad()

    def local_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: every state tensor (a sharded tensor's
        local part), plus the fp32 master weights with fp16. What sharding divides."""
        seen: set[int] = set()
        total = 0
        tensors = [v for st in self.torch_optimizer.state.values() for v in st.values()]
        if self._masters is not None:
            tensors += [m for _, m in self._masters.pairs]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                local = getattr(t, "_local_tensor", t)
                total += local.numel() * local.element_size()
        return total

    def _model(self) -> DistributedModel | None:
        return self._model_ref() if self._model_ref is not None else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.torch_optimizer.add_param_group(param_group)

    def bind(self, binding: OptimizerBinding) -> None:
        """Step only this rank's part of the partitioned model (its ``binding``); once only."""
        if self._localized:
            return
        if self.fp16 and binding.precision is None:
            raise SMPRuntimeError.build(
                "an fp16 / bf16 optimizer binds to a model partitioned without it", True,
                "smp.DistributedOptimizer", "keep 'fp16' / 'bf16' the same from smp.init on")
        local = dict(binding.local_parameters)
        local_ids = {id(p): p for p in local.values()}
        # A local parameter's name may be any alias of a tied one (lm_head.weight for
        # wte.weight): go through the original object to the optimizer's canonical name.
        canon = binding.canonical_names
        by_name = {canon.get(n, n): q for n, q in local.items()}
        if self.fp16 and self._script:
            raise SMPRuntimeError.build(
                "'fp16': true makes DistributedOptimizer SMP's FP16_Optimizer; it wraps a torch "
                "optimizer, not a script's own fp16 optimizer object",
                type(self.optimizer).__name__, "smp.DistributedOptimizer",
                "pass the torch optimizer (drop the script's FP16_Optimizer), or use "
                "'fp16_params' with the script's own")
        index: dict[int, int] = {}
        for group in self.torch_optimizer.param_groups:
            kept: list[torch.Tensor] = []
            for p in group["params"]:
                q = local_ids.get(id(p))
                if q is None:
                    q = by_name.get(self._names.get(id(p), ""))
                if q is not None and all(q is not k for k in kept):
                    kept.append(q)
                    index[id(q)] = self.global_index[id(p)]
            group["params"] = kept
        self.global_index = index
        self._localized = True
        self._local_params = list(local.values())
        self._shards = binding.state_shards(self._local_params)
        if self._shards is not None:  # ZeRO-1: keep only the parameters this rank owns
            shards = self._shards
            for group in self.torch_optimizer.param_groups:
                group["params"] = [p for p in group["params"] if shards.owns(p)]
        if hasattr(self.optimizer, "set_grad_norm_fn"):  # LAMB: the whole model's norm
            self.optimizer.set_grad_norm_fn(self.global_grad_norm)
        if self.fp16 and binding.precision is not None:
            self._masters = MasterWeights(self.torch_optimizer, self._scaler)
            for p, m in self._masters.pairs:
                self.global_index[id(m)] = self.global_index[id(p)]
            binding.precision.scale_with(self)
            if hasattr(next(iter(self._local_params), None), "ds_tensor"):  # sdp's view
                ds_view.attach_masters(self._masters.pairs, *ds_view.coords(state.get()))

    def _smp_index(self, param: torch.Tensor) -> int:
        """As the mixin's, and a script's fp32 master by the model parameter it masters."""
        index = self.global_index.get(id(param))
        if index is None:
            index = self.global_index[model_param_ids(self.optimizer)[id(param)]]
        return index

    def _param_id_to_index(self) -> dict[int, int]:
        """id(parameter) -> index in the optimizer's original flat order: SMP's private method
        that AWS's fp16 helpers call."""
        return {id(p): self._smp_index(p) for g in self.param_groups for p in g["params"]}

    redefined_params = False
    """SMP's flag that parameters were replaced by virtual ones; never in smp-fx."""

    def grads_may_change(self, ops: Sequence[Op]) -> None:
        """Before each step (the model's mixed-precision hook): a training step makes the
        master gradients stale."""
        if self._masters is not None and trains(ops):
            self._masters.mark_stale()

    # ---- checkpoints: fp16 masters and the loss scaler ride in the optimizer state -------
    def local_state_dict(self, cast_to_cpu: bool = True,
                         gather_if_shard: bool = True) -> StateDict:
        """This rank's optimizer state by FQN (fp16: with ``fp32_master`` and ``loss_scaler``);
        ``gather_if_shard`` merges the rdp group's shards, a collective over it."""
        sd = super().local_state_dict(cast_to_cpu, gather_if_shard)
        masters = self._masters
        if masters is not None:
            names = self._smp_flat_names()
            for _, m in masters.pairs:
                name = names[self.global_index[id(m)]]
                assert name is not None
                saved = m.detach().cpu() if cast_to_cpu else m.detach()
                sd["state"].setdefault(name, {})[MASTER_KEY] = saved.clone()
            for g in sd["param_groups"]:
                g[SCALER_KEY] = self._scaler.state_dict()
        # expert_parallel_degree > 1: every expert's state (collective over the ep group)
        sd = gather_optimizer_full(sd, getattr(self._model(), "expert_names", frozenset()))
        if self._shards is not None and gather_if_shard:
            sd = merge_partial_optimizer_states(comm.allgather(sd, comm.RDP_GROUP))
        return sd

    @property
    def shards_state(self) -> bool:
        """Whether this rank holds a shard of its stage's optimizer state (ZeRO-1)."""
        return self._shards is not None

    def _smp_load_now(self, state_dict: Mapping[str, Any]) -> None:
        super()._smp_load_now(state_dict)
        masters = self._masters
        if masters is None:
            return
        loaded = False
        for _, m in masters.pairs:
            saved = self.torch_optimizer.state.get(m, {}).pop(MASTER_KEY, None)
            if saved is not None:
                with torch.no_grad():
                    m.copy_(saved)
                loaded = True
        if not loaded:
            masters.models_to_masters()
        for g in self.torch_optimizer.param_groups:
            sc = g.pop(SCALER_KEY, None)
            if sc is not None:
                self._scaler.load_state_dict(sc)

    def after_model_load(self) -> None:
        """The model's weights were loaded: the fp32 masters follow them."""
        if self._masters is not None:
            self._masters.models_to_masters()


def _norm_scope() -> clip.NormScope:
    """Where this process sums gradient norms (one process before ``smp.init``)."""
    return clip.NormScope.of(state.get() if state.is_initialized() else None)


def _zero_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_()
            p.grad.requires_grad_(False)
            p.grad.zero_()
