"""``smp.DistributedModel``: the user's model, partitioned at the first ``smp.step`` call.

Before partitioning it behaves like the wrapped module (``parameters()`` are the full
model's, so an optimizer can be built over them); ``to``/``cuda`` are ignored with a log, as
SMP does. At the first step the model is traced on the first microbatch, partitioned (the
plan is computed on every rank and rank 0's stage assignment is broadcast, so every rank
runs the same plan even with measured costs), split into stages, and each rank moves only
its own stage's modules to its device. ``model(...)`` and ``model.backward(...)`` are the
points inside an ``smp.step`` function where the pipeline takes over.

Tied parameters (one ``Parameter`` read on several stages): in-process the stages share the
very object, so autograd sums its gradient; across processes each owning rank holds a replica
and the replicas' gradients are all-reduced over a group of the owners after every step.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from cost_model import schedule as sched
from cost_model.device import DEFAULT_DEVICE, DeviceSpec, load_device, spec_for_device_name
from cost_model.errors import (
    SMPConfigError,
    SMPPartitionError,
    SMPRuntimeError,
    not_implemented,
)
from cost_model.measure import measure_nodes
from passes import meta
from passes.pipeline import compile_model
from passes.plan import PartitionPlan
from passes.split_stages import StagedProgram, split_stages
from passes.tensor_parallel import TensorParallelism, TensorParallelPlan
from passes.trace import trace
from smp_fx.activation_checkpointing import checkpoint_rules
from smp_fx.amp import fp16
from smp_fx.ckpt import checkpoint_api
from smp_fx.ckpt.mixins import ModelCheckpointMixin
from smp_fx.delayed_init import is_delayed, materialize
from smp_fx.dist import clip, ddp, launch, sdp, state
from smp_fx.dist.tensor_parallel import TensorParallelRuntime
from smp_fx.manual import pins_by_module_path
from smp_fx.runtime import context
from smp_fx.runtime import executor as ex
from smp_fx.runtime.activations import ActivationKeeper
from smp_fx.runtime.checkpointing import outline_regions
from smp_fx.runtime.dist_transport import DistTransport
from smp_fx.runtime.lowering import cached_schedule
from smp_fx.runtime.modes import Autocast, autocast_state, thread_modes
from smp_fx.runtime.shapes import ShapeGuard, guard_for
from smp_fx.runtime.transport import InProcessTransport, Transport
from smp_fx.tp_marking import marked_paths

if TYPE_CHECKING:
    from smp_fx.optimizer import DistributedOptimizer

log = logging.getLogger("smp_fx.model")

OUTSIDE_STEP = ("The __call__ and backward method calls on the smp.DistributedModel object "
                "can only be made inside a smp.step-decorated function")

@dataclass(frozen=True)
class ModelOptions:
    """The ``DistributedModel`` arguments (DDP ones are kept for the data-parallel work)."""

    trace_device: str = "gpu"
    trace_execution_times: bool = False
    overlapping_allreduce: bool = True
    backward_passes_per_step: int = 1
    average_grads_across_microbatches: bool = True
    bucket_cap_mb: int = 25
    trace_memory_usage: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False


# SMP's state_dict() (ModelCheckpointMixin) takes none of Module.state_dict's arguments
class DistributedModel(ModelCheckpointMixin, nn.Module):  # type: ignore[misc]
    """See the module docstring and the SMP API page (``smp.DistributedModel``)."""

    # torch DDP reads this in its constructor: wrapping a DistributedModel raises (smp_fx.dist.ddp)
    _ddp_params_and_buffers_to_ignore = ddp.RejectDDPWrap()
    options: ModelOptions

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedModel:
        """The module this process's DistributedModel already wraps gives that model back:
        one model per script, as SMP says; the Hugging Face Trainer wraps its base model
        again for every evaluation, which must run on the same partition and parameters."""
        module = args[0] if args else kwargs.get("module")
        current = context.current_model()
        if current is not None and type(current) is cls and current.module is module:
            return current
        return super().__new__(cls)

    def __init__(self, module: nn.Module, trace_device: str = "gpu",
                 trace_execution_times: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: int = 25,
                 trace_memory_usage: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False) -> None:
        options = ModelOptions(
            trace_device, trace_execution_times, overlapping_allreduce,
            backward_passes_per_step, average_grads_across_microbatches, bucket_cap_mb,
            trace_memory_usage, broadcast_buffers, gradient_as_bucket_view)
        if "options" in self.__dict__:  # given back by __new__: already wraps this module
            if options != self.options:
                raise SMPConfigError.build(
                    "smp.DistributedModel called again on the module it wraps, with other "
                    "arguments", {"before": self.options, "now": options},
                    "smp.DistributedModel", "pass the same arguments, or use the model "
                    "returned the first time")
            return
        super().__init__()
        if trace_device not in ("cpu", "gpu"):
            raise SMPConfigError.build("trace_device must be 'cpu' or 'gpu'", trace_device,
                                       "smp.DistributedModel", "pass 'cpu' or 'gpu'")
        if trace_execution_times and trace_device == "cpu":
            raise SMPConfigError.build(
                "trace_execution_times must be False if trace_device is 'cpu'", True,
                "smp.DistributedModel", "set trace_device='gpu' or trace_execution_times=False")
        # a configured feature DistributedModel would use but smp-fx lacks (fp16, tensor
        # parallelism, ...) is an error here, never silently ignored
        if state.is_initialized():
            state.get().config.check_features("DistributedModel")
        if (trace_execution_times or trace_memory_usage) and is_delayed(module):
            raise SMPConfigError.build(
                "trace_execution_times / trace_memory_usage run the model, which a model "
                "built under smp.delay_param_initialization() cannot do", True,
                "smp.DistributedModel", "leave both False (analytic costs need no weights)")
        if isinstance(module, torch.jit.ScriptModule):
            raise SMPConfigError.build("torch.jit.ScriptModules are not supported",
                                       type(module).__name__, "smp.DistributedModel",
                                       "wrap the plain nn.Module")
        self.module = module
        self.options = options
        self._program: StagedProgram | None = None
        self._executor: ex.Executor | None = None
        self._runners: dict[int, ex.StageRunner] = {}
        self._hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._post_step_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizers: list[DistributedOptimizer] = []
        self._tied_groups: list[tuple[Any, list[str]]] = []
        self._tied_duplicates: frozenset[str] = frozenset()
        # tied gradients as they were when the current reduction window began (already
        # summed over the owners): only what the window adds is summed again
        self._tied_base: dict[str, torch.Tensor | None] | None = None
        self._fqn_by_id = {id(p): n for n, p in module.named_parameters()}
        # every alias of a parameter -> its first name (tied weights), fixed before any
        # materialisation replaces parameter objects
        self.canonical_names = {n: self._fqn_by_id[id(p)] for n, p in
                                module.named_parameters(remove_duplicate=False)}
        self.plan: PartitionPlan | None = None  # once partitioned
        self.tp_plan: TensorParallelPlan | None = None  # once partitioned, with tp > 1
        self._tp: TensorParallelRuntime | None = None
        self._shapes: ShapeGuard | None = None  # once partitioned
        self._ddp: ddp.DataParallel | None = None
        self._sdp: sdp.ShardedDataParallel | None = None
        self._loss_scale: Callable[[], float] | None = None
        cfg = state.get().config if state.is_initialized() else None
        self._fp16 = bool(cfg is not None and cfg.fp16)
        if cfg is not None and (cfg.fp16 or cfg.fp16_params):
            module.half()  # same Parameter objects: an optimizer built earlier still holds them
        context.set_current_model(self)
        checkpoint_api.adopt_pending(model=self)  # smp.resume_from_checkpoint came first
        for opt in context.waiting_optimizers():
            if self.owns_parameters(opt.parameters_held()):
                opt.join_model(self)

    # ---- properties and the SMP methods ----------------------------------------------
    @property
    def partitioned(self) -> bool:
        return self._program is not None

    @property
    def program(self) -> StagedProgram:
        if self._program is None:
            raise SMPRuntimeError.build("the model is not partitioned yet", None,
                                        "DistributedModel.program",
                                        "call an smp.step function first")
        return self._program

    @property
    def executor(self) -> ex.Executor:
        assert self._executor is not None
        return self._executor

    def get_module(self) -> nn.Module:
        return self.module

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a tensor-parallel shard (False before partitioning)."""
        return self._tp is not None and self._tp.is_distributed(param)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._fp16:  # FP16_Module: half inputs in, fp32 outputs out
            args, kwargs = fp16.half_inputs(args, kwargs)
        if context.capturing_inputs():
            raise context.Captured(args, kwargs, autocast_state())
        ctx = context.turn()
        if ctx is None or self._executor is None or ctx[0] is not self._executor.conductor:
            raise SMPRuntimeError.build(OUTSIDE_STEP, None, "DistributedModel.__call__",
                                        "call the model inside an @smp.step function")
        if self._shapes is not None:
            self._shapes.check_call(args, kwargs)
        out = ctx[0].forward_request(ctx[1], args, kwargs)
        return fp16.float_outputs(out) if self._fp16 else out

    @property
    def loss_scale(self) -> float:
        """What ``model.backward`` multiplies the loss by: the fp16 optimizer's loss scale
        (``smp.DistributedOptimizer`` with ``fp16``), else 1."""
        return self._loss_scale() if self._loss_scale is not None else 1.0

    def set_loss_scale(self, scale: Callable[[], float]) -> None:
        """Let an fp16 optimizer supply the loss scale of every later backward."""
        self._loss_scale = scale

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Distributed backward across the stages; like ``torch.autograd.backward``."""
        ctx = context.turn()
        if ctx is None or self._executor is None or ctx[0] is not self._executor.conductor:
            raise SMPRuntimeError.build(OUTSIDE_STEP, None, "DistributedModel.backward",
                                        "call model.backward inside an @smp.step function")
        self._executor.conductor.backward_request(ctx[1], tensors, grad_tensors)

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Run ``hook(model)`` (or ``hook(model, optimizer)``) right after partitioning."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def register_post_step_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Run ``hook(model, optimizer)`` once, when the next ``smp.step`` call has finished
        (before ``optimizer.step()``): the Hugging Face Trainer loads a resumed optimizer's
        state this way. ``optimizer`` is this model's DistributedOptimizer, or None."""
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def run_post_step_hooks(self) -> None:
        """Called by ``smp.step`` after each step: the hooks registered since the last one."""
        while self._post_step_hooks:
            _, hook = self._post_step_hooks.popitem(last=False)
            hook(self, self._optimizers[0] if self._optimizers else None)

    def owns_parameters(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params`` is a parameter of the wrapped module, as it was at
        wrapping (materialisation may replace the objects later)."""
        return any(id(p) in self._fqn_by_id for p in params)

    def attach_optimizer(self, optimizer: DistributedOptimizer) -> None:
        """Narrow ``optimizer`` to this rank's parameters at partitioning (at once if the
        model is partitioned); the first one attached is what post-partition hooks get."""
        self._optimizers.append(optimizer)
        if self.partitioned:
            optimizer._localize(self)

    def tied_duplicates(self) -> frozenset[str]:
        """Local parameter names (``local_named_parameters``') that replicate a tied
        parameter a lower pipeline stage also holds (in-process stages share one object,
        so there are none)."""
        return self._tied_duplicates

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every local gradient by the total norm of the whole (unpartitioned) model,
        as FSDP's ``clip_grad_norm_``; returns that norm. Call it on every rank after the
        ``smp.step`` call (it is a collective over the model-parallel group); see
        ``smp_fx.dist.clip``."""
        return clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    @property
    def shards_parameters(self) -> bool:
        """Whether sharded data parallelism holds the local parameters as shards."""
        return self._sdp is not None

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers (see ``ModelCheckpointMixin``)."""
        if self.shards_parameters:
            raise not_implemented(
                "checkpoints of sharded data parallel models", "sharded_data_parallel_degree",
                "checkpoint without sharded data parallelism (optimizer-state sharding, "
                "shard_optimizer_state, checkpoints)")
        return super().local_state_dict()

    def _smp_load_now(self, state_dict: Any, strict: bool) -> Any:
        result = super()._smp_load_now(state_dict, strict)
        for opt in self._optimizers:  # fp16: the fp32 masters follow the loaded weights
            opt.after_model_load()
        return result

    def join(self, throw_on_early_termination: bool = False) -> Any:
        """Context manager for uneven numbers of batches across data-parallel ranks (ddp)."""
        if state.get().config.sharded_data_parallel_degree > 1:
            raise not_implemented("DistributedModel.join() with sharded data parallelism",
                                  "sharded_data_parallel_degree",
                                  "give every data-parallel rank the same number of batches")
        return ddp.join(self, throw_on_early_termination)

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        seen: set[int] = set()
        for r in self._local_runners():
            for name, m in r.stage.module.named_modules():
                if name and id(m) not in seen and not isinstance(m, torch.fx.GraphModule):
                    seen.add(id(m))
                    yield name, m

    def local_modules(self) -> Iterator[nn.Module]:
        return (m for _, m in self.local_named_modules())

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by the names plain ``named_parameters()`` of the wrapped
        module gives: a tied parameter by its first registration (T5's ``shared.weight``,
        GPT-2's ``transformer.wte.weight``), whichever alias its stage reads it by."""
        seen: set[int] = set()
        for r in self._local_runners():
            for name, p in r.stage.module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self.canonical_names.get(name, name), p

    # As SMP's: the wrapped module's names, without a "module." prefix, so name-based
    # parameter groups built on the plain model apply unchanged to the DistributedModel.
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def local_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for r in self._local_runners():
            for name, b in r.stage.module.named_buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    yield name, b

    def local_buffers(self) -> Iterator[torch.Tensor]:
        return (b for _, b in self.local_named_buffers())

    def _local_runners(self) -> list[ex.StageRunner]:
        if self._program is None:
            raise SMPRuntimeError.build("local_* methods need the partitioned model", None,
                                        "DistributedModel", "call an smp.step function first")
        return [self._runners[s] for s in sorted(self._runners)]

    def to(self, *args: Any, **kwargs: Any) -> DistributedModel:
        log.info("smp-fx: DistributedModel.to(%s) ignored: each rank places its own stage",
                 args or kwargs)
        return self

    def cuda(self, device: Any = None) -> DistributedModel:
        log.info("smp-fx: DistributedModel.cuda() ignored: each rank places its own stage")
        return self

    def cpu(self) -> nn.Module:  # type: ignore[override]
        """Gather every stage's parameters and buffers onto CPU; returns the full module."""
        if self._program is None or self._in_process:
            return self.module.cpu()
        local = {n: t.detach().cpu() for n, t in
                 list(self.local_named_parameters()) + list(self.local_named_buffers())}
        st = state.get()
        gathered: list[Any] = [None] * st.axis_size("pp")
        dist.all_gather_object(gathered, local, group=st.object_group("pp"))
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        full = self.module.cpu()
        with torch.no_grad():
            for name, t in list(full.named_parameters(remove_duplicate=False)) + \
                    list(full.named_buffers(remove_duplicate=False)):
                if name in merged:
                    t.copy_(merged[name])
        return full

    # ---- partitioning ------------------------------------------------------------------
    @property
    def _in_process(self) -> bool:
        return self._transport_kind == "in_process"

    def _partition(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                   autocast: Autocast = ()) -> None:
        """Trace on one microbatch's model inputs, plan, split, place; same on every rank.

        ``autocast`` is the step function's autocast at its ``model(...)`` call: shapes and
        costs are taken under it, so the plan counts the bytes the stages will hold."""
        st = state.get()
        cfg = st.config
        p = cfg.pipeline_parallel_degree
        multi = not st.in_process and st.axis_size("pp") > 1
        if not multi and is_delayed(self.module):
            # every stage lives in this process: materialise the whole model once, which
            # keeps tied parameters tied (one Parameter shared by the stages)
            materialize(self.module, st.device)
        with context.tracing():
            gm, self.plan, self.tp_plan = _plan_stages(self.module, args, kwargs, p,
                                                       self.options, autocast)
        if not st.in_process and st.world_size > 1:
            _agree_on_plan(gm, st)
        program = split_stages(gm, p)
        timeout_s = launch.timeout().total_seconds()
        transport: Transport
        if multi:
            pp_rank = st.axis_rank("pp")
            local = [pp_rank]
            devices = {pp_rank: st.device}
            transport = DistTransport(st.group_ranks("pp"), pp_rank, st.device, timeout_s,
                                      DistTransport.make_groups())
        else:
            local = list(range(p))
            devices = _in_process_devices(p, st.device, program)
            transport = InProcessTransport(devices)
        self._transport_kind = "dist" if multi else "in_process"
        runners = {s: ex.StageRunner(program.stages[s], devices[s]) for s in local}
        delayed = any(is_delayed(r.module) for r in runners.values())
        # tied parameters are found by the original objects, before materialising
        self._tied_groups = _tied_groups(program, st, self.canonical_names) if multi else []
        if multi:
            self._tied_duplicates = _tied_duplicates(program, pp_rank, self.canonical_names)
        for s, r in runners.items():
            _materialise(r.module, devices[s])
        self._program, self._runners = program, runners
        self._executor = ex.Executor(program, runners, transport, multi, timeout_s, st.rank,
                                     st.group_ranks("pp") if multi else None)
        self._shapes = guard_for(gm, program)
        if multi and self._shapes.active:
            self._executor.check_received = self._shapes.check_received
        self._checkpoint_stages(runners, cfg)
        if multi:
            if self._tied_groups:
                self._executor.pre_step_hooks.append(self._snapshot_tied_grads)
                self._executor.post_step_hooks.append(self._reduce_tied_grads)
                if delayed:  # replicas initialised on different ranks: take the first's
                    self._broadcast_tied()
        if self.tp_plan is not None:
            self._tp = TensorParallelRuntime.attach(self, self.tp_plan, st)
        if cfg.sharded_data_parallel_degree > 1:
            self._sdp = sdp.enable(self)
        else:
            self._ddp = ddp.enable(self)  # None unless ddp with several replicas
        for opt in self._optimizers:
            opt._localize(self)
        for hook in list(self._hooks.values()):
            n = len(inspect.signature(hook).parameters)
            first = self._optimizers[0] if self._optimizers else None
            hook(*(self, first)[:n])

    def _checkpoint_stages(self, runners: dict[int, ex.StageRunner], cfg: Any) -> None:
        """Each local stage runs its checkpointed regions under torch's checkpoint, and
        gets the saved-tensor hooks that offload their inputs (``offload_activations``)."""
        assert self.plan is not None and self._executor is not None
        if cfg.offload_activations and not any(st.checkpointed for st in self.plan.stages):
            raise SMPConfigError.build(
                "'offload_activations' moves checkpointed regions' inputs, and no module "
                "is checkpointed", True, "smp.DistributedModel (first smp.step)",
                "call smp.set_activation_checkpointing(module) before the first step, or "
                "drop 'offload_activations'")
        self._executor.loading_horizon = cfg.activation_loading_horizon
        for s, r in runners.items():
            outline_regions(r.stage.module)
            state_tensors = [*r.stage.module.parameters(), *r.stage.module.buffers()]
            self._executor.keepers[s] = ActivationKeeper(state_tensors,
                                                         offload=cfg.offload_activations)

    def _broadcast_tied(self) -> None:
        """Give every replica of a tied parameter the lowest owning rank's values."""
        params = dict(self.local_named_parameters())
        for group, names in self._tied_groups:
            src = min(dist.get_process_group_ranks(group))
            with torch.no_grad():
                for n in names:
                    dist.broadcast(params[n].data, src=src, group=group)

    def _snapshot_tied_grads(self, ops: Any) -> None:
        """At the start of a reduction window, remember the tied gradients (already summed)."""
        if self._tied_base is not None:
            return  # ddp accumulating over several steps: the window began earlier
        params = dict(self.local_named_parameters())
        grads = {n: params[n].grad for _, names in self._tied_groups for n in names}
        self._tied_base = {n: None if g is None else _local_view(g).detach().clone()
                           for n, g in grads.items()}

    def _reduce_tied_grads(self) -> None:
        """Sum the gradients of parameters replicated on several stages over their owners.

        Only what this reduction window added is summed: a user accumulating over several
        steps without ``zero_grad`` must not have earlier (already summed) gradients summed
        again. After a dp reduction the base is equal on every replica, so the dp average
        of base + local additions is base + the average of the additions.
        """
        if self._ddp is not None and not self._ddp.reduce_this_step:
            return  # ddp accumulating (backward_passes_per_step): sum once, when dp reduces
        params = dict(self.local_named_parameters())
        base = self._tied_base or {}
        self._tied_base = None
        for group, names in self._tied_groups:
            ts = [params[n] for n in names]
            parts = []
            for n, p in zip(names, ts):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = _local_view(p.grad)
                b = base.get(n)
                parts.append((g - b if b is not None else g).reshape(-1))
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=group)
            offset = 0
            for n, p in zip(names, ts):
                assert p.grad is not None
                local = _local_view(p.grad)
                g = flat[offset:offset + local.numel()].view_as(local)
                offset += local.numel()
                b = base.get(n)
                local.copy_(g + b if b is not None else g)

    def schedule(self, num_microbatches: int, forward_only: bool) -> sched.Schedule:
        cfg = state.get().config
        return cached_schedule(cfg.pipeline, cfg.pipeline_parallel_degree, num_microbatches,
                               cfg.active_microbatches, forward_only)


def _local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a sharded (DTensor) gradient, else
    ``t``. Tied replicas on several stages are sharded alike over equal dp groups, so
    their shards line up."""
    return getattr(t, "_local_tensor", t)


def _in_process_devices(p: int, device: torch.device,
                        program: StagedProgram) -> dict[int, torch.device]:
    """cuda:0..p-1 when there are that many GPUs and no tied parameters, else one device."""
    if device.type == "cuda" and torch.cuda.device_count() >= p and not _has_tied(program):
        return {s: torch.device("cuda", s) for s in range(p)}
    return {s: device for s in range(p)}


def _has_tied(program: StagedProgram) -> bool:
    seen: set[int] = set()
    for st in program.stages:
        ids = {id(p) for p in st.module.parameters()}
        if ids & seen:
            return True
        seen |= ids
    return False


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Place one stage's parameters on ``device``; meta (delayed-init) ones are created there.

    Delayed initialisation (``smp.delay_param_initialization``): the stage's modules get
    ``to_empty`` then ``reset_parameters`` (``smp_fx.delayed_init.materialize``), so only
    this rank's stage is ever allocated. The values then differ from an eagerly built model
    with the same seed (the RNG stream is consumed per stage, not for the whole model);
    tied replicas on several ranks are made equal by a broadcast from the first owner.
    """
    if is_delayed(module):
        materialize(module, device)
        return
    module.to(device)


def _plan_stages(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 num_stages: int, options: ModelOptions, autocast: Autocast = ()
                 ) -> tuple[torch.fx.GraphModule, PartitionPlan, TensorParallelPlan | None]:
    """Trace once, cost and partition with the compile pipeline; (GraphModule with STAGE, plan).

    Analytic costs for the device spec ``_plan_device`` picks (the same on every rank), so
    the plan is a pure function of the model, the first microbatch, the configuration and
    that spec (every rank makes the same one). With ``auto_partition`` false the
    ``smp.partition`` pins apply. Measured costs are taken on the very graph that is then
    costed, planned and split (``compile_model``'s ``traced``), which keeps the front end's
    codegen (export's input and output structure).
    """
    st = state.get()
    cfg = st.config
    pins = None if cfg.auto_partition else pins_by_module_path(module)
    device = _plan_device(st)
    gm = trace(module, args, kwargs)
    measured = None
    if options.trace_execution_times or options.trace_memory_usage:
        with thread_modes(torch.is_grad_enabled(), autocast):
            measured = _measured_costs(gm, args, kwargs, options, st)
    pconfig = cfg.partition_config(device.name, checkpointing=checkpoint_rules(module))
    tp = TensorParallelism(st.axis_size("tp"), st.axis_rank("tp"), cfg.prescaled_batch,
                           marked_paths(module))
    with thread_modes(torch.is_grad_enabled(), autocast):
        compiled = compile_model(module, args, kwargs, pconfig, device=device, pins=pins,
                                 measured=measured, traced=gm, tp=tp)
    return compiled.gm, compiled.plan, compiled.tp_plan


DEVICE_SPEC_ENV = "SMP_FX_DEVICE_SPEC"


def _plan_device(st: state.State) -> DeviceSpec:
    """The ``DeviceSpec`` to plan for, the same on every rank.

    ``SMP_FX_DEVICE_SPEC`` (a built-in name or a file written by ``smp-fx calibrate``)
    wins; otherwise the built-in spec named in this GPU's name (H100, A100, V100), or
    "cpu" (measured here, quick) on CPU. World rank 0 resolves it and broadcasts it: a
    measured spec differs from rank to rank, and every rank must make the same plan. A
    bad spec is broadcast as its error, so every rank raises it instead of waiting.
    """
    box: list[Any] = [None]
    if st.rank == 0:
        name = os.environ.get(DEVICE_SPEC_ENV)
        if not name and st.device.type == "cuda":
            gpu = torch.cuda.get_device_name(st.device)
            name = spec_for_device_name(gpu)
            if name is None:
                log.warning("no built-in device spec for %r: planning for %r; set %s to a "
                            "spec file from `smp-fx calibrate` to plan for this GPU", gpu,
                            DEFAULT_DEVICE, DEVICE_SPEC_ENV)
                name = DEFAULT_DEVICE
        try:
            box = [load_device(name or st.device.type).to_json()]
        except SMPConfigError as exc:
            box = [str(exc)]
    if not st.in_process and st.world_size > 1:
        dist.broadcast_object_list(box, src=0, group=st.object_group("world"))
    if isinstance(box[0], str):
        raise SMPConfigError(f"{box[0]} (from {DEVICE_SPEC_ENV} or the device, on rank 0)")
    return DeviceSpec.from_json(box[0])


def _measured_costs(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                    options: ModelOptions, st: state.State) -> dict[str, tuple[Any, Any, Any]]:
    """Per-node measured costs (``trace_execution_times`` / ``trace_memory_usage``), taken
    on world rank 0 and broadcast: measurements are noisy, and every rank must make the
    same plan. A field not asked for is None, so it keeps its analytic value."""
    times, memory = options.trace_execution_times, options.trace_memory_usage
    box: list[Any] = [None]
    if st.rank == 0:
        raw = measure_nodes(gm, args, kwargs, times=times, memory=memory)
        box = [{name: (f if times else None, b if times else None, m if memory else None)
                for name, (f, b, m) in raw.items()}]
    if not st.in_process and st.world_size > 1:
        dist.broadcast_object_list(box, src=0, group=st.object_group("world"))
    return box[0]


def _agree_on_plan(gm: torch.fx.GraphModule, st: state.State) -> None:
    """Adopt world rank 0's stage assignment (measured costs may differ between ranks)."""
    mine = [(n.name, meta.STAGE.get(n)) for n in gm.graph.nodes]
    box = [mine]
    dist.broadcast_object_list(box, src=0, group=st.object_group("world"))
    theirs = box[0]
    if [n for n, _ in theirs] != [n for n, _ in mine]:
        raise SMPPartitionError.build(
            "ranks traced different graphs", f"{len(theirs)} vs {len(mine)} nodes",
            f"rank {st.rank}", "make the model and first batch identical on every rank")
    for node, (_, stage) in zip(gm.graph.nodes, theirs):
        if stage is not None:
            meta.STAGE.set(node, stage)


def _tied_duplicates(program: StagedProgram, stage: int,
                     canonical: dict[str, str]) -> frozenset[str]:
    """Names (canonical, as ``local_named_parameters`` gives them) of ``stage``'s parameters
    whose tied twin a lower stage holds too."""
    lower = {canonical.get(n, n) for s in range(stage)
             for n, _ in program.stages[s].module.named_parameters()}
    mine = {canonical.get(n, n) for n, _ in program.stages[stage].module.named_parameters()}
    return frozenset(mine & lower)


def _tied_groups(program: StagedProgram, st: state.State,
                 canonical: dict[str, str]) -> list[tuple[Any, list[str]]]:
    """Groups of the pp ranks owning each tied parameter; created collectively on all ranks.

    Tied-ness comes from the original module's aliases (``canonical``: every name -> its
    first name), never from parameter identity here: a delayed (meta) model's stages may
    hold re-created parameters, and every rank must agree on the groups it creates.
    """
    owners: dict[str, list[int]] = {}
    for s, stage in enumerate(program.stages):
        for name, _ in stage.module.named_parameters():
            canon = canonical.get(name, name)
            owners.setdefault(canon, [])
            if s not in owners[canon]:
                owners[canon].append(s)
    by_owner_set: dict[tuple[int, ...], list[str]] = {}
    for canon, stages in sorted(owners.items()):
        if len(stages) > 1:
            by_owner_set.setdefault(tuple(stages), []).append(canon)
    out: list[tuple[Any, list[str]]] = []
    for owner_stages, canons in sorted(by_owner_set.items()):
        for pipeline in st.topology.groups("pp"):
            ranks = [pipeline[s] for s in owner_stages]
            group = dist.new_group(ranks)
            if st.rank in ranks:  # local_named_parameters() names them canonically too
                out.append((group, list(canons)))
    return out
