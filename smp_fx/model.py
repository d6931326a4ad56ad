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

What runs the partitioned model (stages, runners, executor, and every parallelism in its
order) is one value, ``parallelized``, built by ``smp_fx.parallel.build.parallelize``.
Optimizers bind to it through ``DistributedOptimizer.bind``.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from cost_model import schedule as sched
from cost_model.errors import (
    SMPConfigError,
    SMPRuntimeError,
    not_implemented,
)
from passes.plan import PartitionPlan
from passes.split_stages import StagedProgram
from passes.tensor_parallel import TensorParallelPlan
from passes.tensor_parallel.coverage import Coverage, coverage
from smp_fx.amp import fp16
from smp_fx.ckpt import async_save, checkpoint_api
from smp_fx.ckpt.mixins import ModelCheckpointMixin
from smp_fx.ckpt.pretrained import SafetensorsState, pretrained_files
from smp_fx.ckpt.state_dict import ModelLayout
from smp_fx.ckpt.unread_state import unread_state
from smp_fx.ckpt.view import CheckpointView, Ranks
from smp_fx.marking.delayed_init import allocate, extending, is_delayed, materialize
from smp_fx.marking.tp_register import replace_registered
from smp_fx.model_options import ModelOptions
from smp_fx.model_tp_queries import TensorParallelQueries
from smp_fx.model_walks import ModuleWalks
from smp_fx.module_view import ModuleView, module_chain
from smp_fx.nn.attention_checkpointing import checkpoint_attentions
from smp_fx.optimizer import DistributedOptimizer
from smp_fx.parallel import clip, ddp, ds_view
from smp_fx.parallel.build import Parallelized, parallelize
from smp_fx.parallel.ep_experts import split_experts
from smp_fx.parallel.expert_parallel import expert_names
from smp_fx.runtime.executor import executor as ex
from smp_fx.runtime.executor.lowering import cached_schedule
from smp_fx.runtime.executor.modes import Autocast, autocast_state
from smp_fx.runtime.executor.seams import StageRunner
from smp_fx.runtime.planning.placement import multi_process
from smp_fx.runtime.planning.planning import plan_stages
from smp_fx.world import context, state
from smp_fx.world import state as smp_state

log = logging.getLogger("smp_fx.model")

OUTSIDE_STEP = ("The __call__ and backward method calls on the smp.DistributedModel object "
                "can only be made inside a smp.step-decorated function")

# SMP's state_dict() (ModelCheckpointMixin) takes none of Module.state_dict's arguments
class DistributedModel(ModelCheckpointMixin, TensorParallelQueries, ModuleWalks,  # type: ignore[misc]
                       nn.Module):
    """See the module docstring and the SMP API page (``smp.DistributedModel``)."""

    # torch DDP reads this in its constructor: wrapping a DistributedModel raises
    # (smp_fx.parallel.ddp)
    _ddp_params_and_buffers_to_ignore = ddp.RejectDDPWrap()
    options: ModelOptions

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedModel:
        """The module this process's DistributedModel already wraps gives that model back:
        one model per script, as SMP says; the Hugging Face Trainer wraps its base model
        again for every evaluation, which must run on the same partition and parameters."""
        module = args[0] if args else kwargs.get("module")
        current = context.current_model()
        if isinstance(current, cls) and type(current) is cls and \
                (current.get_module() is module or current.script_module() is module):
            return current
        return super().__new__(cls)

    def __init__(self, module: nn.Module, trace_device: str = "gpu",
                 trace_execution_times: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: int = 25,
                 trace_memory_usage: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False) -> None:
        st = state.get() if state.is_initialized() else None
        cfg = st.config if st is not None else None
        # SMP's BERT tutorial sets overlapping_allreduce in the configuration: false there
        # turns the overlap off for the model too
        overlapping_allreduce = overlapping_allreduce and (cfg is None
                                                           or cfg.overlapping_allreduce)
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
        options.check(module)
        # what the script built (the root may be replaced below; not kept alive)
        object.__setattr__(self, "_script_module", weakref.ref(module))
        # smp.tp_register and SMP's Hugging Face replacements: marked instances -> distributed
        module = replace_registered(module)
        # expert_parallel_degree > 1: each MoE block keeps this rank's slice of its experts
        self.ep_coverage = split_experts(module, st)
        self.expert_names = expert_names(b.path for b in self.ep_coverage if not b.reason)
        self._checkpoint_ranks = Ranks(st)
        self._layout: ModelLayout | None = None  # taken at the first checkpoint_view()
        if cfg is not None and cfg.checkpoint_attentions:
            checkpoint_attentions(module)
        self._modules["module"] = module  # get_module() reads it; .module is SMP's view
        self.stand_in_for_root(module)
        self.options = options
        self._parallelized: Parallelized | None = None  # once partitioned
        self._unread: dict[str, torch.Tensor] | None = None
        self._hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._post_step_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizers: list[DistributedOptimizer] = []
        # join() before the first step: the data parallelism the build will apply
        self._early_dp: ddp.DataParallel | None = None
        self._fqn_by_id = {id(p): n for n, p in module.named_parameters()}
        # every alias of a parameter -> its first name (tied weights), fixed before any
        # materialisation replaces parameter objects
        self.canonical_names = {n: self._fqn_by_id[id(p)] for n, p in
                                module.named_parameters(remove_duplicate=False)}
        self.plan: PartitionPlan | None = None  # once partitioned
        self.tp_plan: TensorParallelPlan | None = None  # once partitioned, with tp > 1
        self._half = fp16.training_dtype(cfg)  # fp16 or bf16 training: half in, fp32 out
        if cfg is not None and (cfg.fp16 or cfg.fp16_params or cfg.bf16):
            # same Parameter objects: an optimizer built earlier still holds them; a
            # delayed module's cast is recorded with its construction (materialised cast)
            with extending(module):
                module.to(self._half or fp16.HALF)
        if cfg is not None and cfg.sharded_data_parallel_degree > 1:  # SMP's DeepSpeed view
            ds_view.attach_whole(module.parameters(), *ds_view.coords(state.get()))
        context.set_current_model(self)
        files = pretrained_files(module)
        if files is not None:  # from_pretrained under delay_param_initialization
            self.load_state_dict(SafetensorsState(files))  # each rank its stages, once placed
        checkpoint_api.adopt_pending(model=self)  # smp.resume_from_checkpoint came first
        for opt in context.waiting_optimizers():
            if isinstance(opt, DistributedOptimizer) and \
                    self.owns_parameters(opt.parameters_held()):
                opt.join_model(self)

    def script_module(self) -> nn.Module | None:
        """The module the script passed in (``module`` unless its root was replaced by its
        distributed version), while it is alive."""
        ref: weakref.ref[nn.Module] = self.__dict__["_script_module"]
        return ref()

    # ---- properties and the SMP methods ----------------------------------------------
    @property
    def partitioned(self) -> bool:
        return self._parallelized is not None

    @property
    def parallelized(self) -> Parallelized:
        """What runs the partitioned model: stages, runners, executor and the parallelisms
        the build applied, in order (``smp_fx.parallel.build``)."""
        if self._parallelized is None:
            raise SMPRuntimeError.build("the model is not partitioned yet", None,
                                        "DistributedModel", "call an smp.step function first")
        return self._parallelized

    @property
    def program(self) -> StagedProgram:
        return self.parallelized.program

    @property
    def executor(self) -> ex.Executor:
        return self.parallelized.executor

    def get_module(self) -> nn.Module:
        """The module this model wraps (SMP 1.11+)."""
        return self._modules["module"]  # type: ignore[return-value]

    def tp_coverage(self) -> Coverage | None:
        """How much tensor parallelism shards (``passes.tensor_parallel.coverage``): the
        share of parameter elements sharded, each replicated linear or embedding and each
        lone linear with the reason; None before partitioning or at degree 1."""
        return None if self.tp_plan is None else coverage(self.tp_plan)

    def checkpoint_view(self) -> CheckpointView:
        """What checkpoints read of this model (``smp_fx.ckpt.view``); the layout is the
        plain model's, taken before partitioning when a load comes first."""
        if self._layout is None:
            self._layout = ModelLayout.from_module(self.get_module())
        return CheckpointView(self._checkpoint_ranks, self._layout, self.tp_plan,
                              self.expert_names, self.shards_parameters)

    @property
    def module(self) -> ModuleView:
        """SMP v1's wrapper chain above the wrapped module (``smp_fx.module_view``):
        ``model.module.module`` is the module, under ``FP16_Module`` with fp16."""
        return module_chain(self.get_module(), self._half is not None, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._half is not None:  # FP16_Module: half inputs in, fp32 outputs out
            args, kwargs = fp16.half_inputs(args, kwargs, self._half)
        if context.capturing_inputs():
            raise context.Captured(args, kwargs, autocast_state())
        ctx = context.turn()
        built = self._parallelized
        if ctx is None or built is None or ctx[0] is not built.executor.conductor:
            raise SMPRuntimeError.build(OUTSIDE_STEP, None, "DistributedModel.__call__",
                                        "call the model inside an @smp.step function")
        built.shapes.check_call(args, kwargs)
        out = ctx[0].forward_request(ctx[1], args, kwargs)
        return fp16.float_outputs(out, self._half) if self._half is not None else out

    @property
    def loss_scale(self) -> float:
        """What ``model.backward`` multiplies the loss by: the loss scale of the fp16
        optimizer bound to the model (``smp.DistributedOptimizer`` with ``fp16``), else 1."""
        built = self._parallelized
        if built is None or built.precision is None:
            return 1.0
        return built.precision.loss_scale

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Distributed backward across the stages; like ``torch.autograd.backward``."""
        ctx = context.turn()
        built = self._parallelized
        if ctx is None or built is None or ctx[0] is not built.executor.conductor:
            raise SMPRuntimeError.build(OUTSIDE_STEP, None, "DistributedModel.backward",
                                        "call model.backward inside an @smp.step function")
        ctx[0].backward_request(ctx[1], tensors, grad_tensors)

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
        """Bind ``optimizer`` to this rank's part of the model at partitioning (at once if
        the model is partitioned); the first one attached is what post-partition hooks get."""
        self._optimizers.append(optimizer)
        if self._parallelized is not None:
            optimizer.bind(self._parallelized.binding())

    def tied_duplicates(self) -> frozenset[str]:
        """Local parameter names (``local_named_parameters``') that replicate a tied
        parameter a lower pipeline stage also holds (in-process stages share one object,
        so there are none; none before partitioning)."""
        built = self._parallelized
        return built.tied_duplicates if built is not None else frozenset()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every local gradient by the total norm of the whole (unpartitioned) model,
        as FSDP's ``clip_grad_norm_``; returns that norm. Call it on every rank after the
        ``smp.step`` call (it is a collective over the model-parallel group); see
        ``smp_fx.parallel.clip``."""
        scope = clip.NormScope.of(state.get() if state.is_initialized() else None)
        return clip.clip_grad_norm_(scope, self, max_norm, norm_type, error_if_nonfinite)

    @property
    def shards_parameters(self) -> bool:
        """Whether sharded data parallelism holds the local parameters as shards."""
        return self._parallelized is not None and self._parallelized.sharded is not None

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers (see ``ModelCheckpointMixin``); under sharded
        data parallelism whole tensors, gathered over the shard group (a collective:
        every rank of it calls this; ``smp_fx.ckpt.sdp_shards``)."""
        return super().local_state_dict()

    def _smp_load_now(self, state_dict: Any, strict: bool) -> Any:
        result = super()._smp_load_now(state_dict, strict)
        for opt in self._optimizers:  # fp16: the fp32 masters follow the loaded weights
            opt.after_model_load()
        return result

    def join(self, throw_on_early_termination: bool = False) -> Any:
        """Context manager for uneven numbers of batches across data-parallel ranks (ddp)."""
        st = state.get()
        if st.config.sharded_data_parallel_degree > 1:
            raise not_implemented("DistributedModel.join() with sharded data parallelism",
                                  "sharded_data_parallel_degree",
                                  "give every data-parallel rank the same number of batches")
        ddp.check_join(st.config)
        if self._parallelized is not None:
            dp = self._parallelized.data_parallel
        else:  # the first step runs inside: the build applies this one
            dp = self._early_dp = self._early_dp or ddp.controller(self.options, st)
        if dp is not None:  # step counts may differ from here: saves agree elsewhere
            async_save.stop_at_steps()
        return ddp.join(dp, throw_on_early_termination)

    def register_comm_hook(self, state: object,
                           callable: Callable[..., Any]) -> None:  # noqa: A002 - SMP's name
        """Register a DDP communication hook on every local stage's DDP wrapper (SMP's:
        ``ddp`` with ``overlapping_allreduce``; the hook then averages, as SMP warns)."""
        hook = callable
        st = smp_state.get()
        ddp.check_comm_hook(self.options, st.config)
        if self._parallelized is not None:
            dp = self._parallelized.data_parallel
        else:  # the build applies this one, with its hooks
            dp = self._early_dp = self._early_dp or ddp.controller(self.options, st)
        if dp is None:  # one replica: DDP is not built, nothing is reduced
            log.warning("smp-fx: register_comm_hook: one data-parallel replica, so no "
                        "gradient reduction runs and the hook is never called")
            return
        dp.register_comm_hook(state, hook)

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
        return self._local().local_named_parameters()

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

    def local_unread_state(self) -> dict[str, torch.Tensor]:
        """The wrapped module's state that no stage reads, kept by the rank of stage 0
        (``smp_fx.ckpt.unread_state``); empty elsewhere."""
        local = self._local()
        if 0 not in local.runners:
            return {}
        if self._unread is None:
            stages = [s.module for s in local.program.stages]
            self._unread = unread_state(self.get_module(), stages)
        return self._unread

    def _local(self) -> Parallelized:
        if self._parallelized is None:
            raise SMPRuntimeError.build("local_* methods need the partitioned model", None,
                                        "DistributedModel", "call an smp.step function first")
        return self._parallelized

    def _local_runners(self) -> list[StageRunner]:
        runners = self._local().runners
        return [runners[s] for s in sorted(runners)]

    def to(self, *args: Any, **kwargs: Any) -> DistributedModel:
        log.info("smp-fx: DistributedModel.to(%s) ignored: each rank places its own stage",
                 args or kwargs)
        return self

    def cuda(self, device: Any = None) -> DistributedModel:
        log.info("smp-fx: DistributedModel.cuda() ignored: each rank places its own stage")
        return self

    def cpu(self) -> nn.Module:  # type: ignore[override]
        """Gather every stage's parameters and buffers onto CPU; returns the full module."""
        if self._parallelized is None or not self._parallelized.multi:
            return self.get_module().cpu()
        local = {n: t.detach().cpu() for n, t in
                 list(self.local_named_parameters()) + list(self.local_named_buffers())}
        st = state.get()
        gathered: list[Any] = [None] * st.axis_size("pp")
        dist.all_gather_object(gathered, local, group=st.object_group("pp"))
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        full = self.get_module().cpu()
        with torch.no_grad():
            for name, t in list(full.named_parameters(remove_duplicate=False)) + \
                    list(full.named_buffers(remove_duplicate=False)):
                if name in merged:
                    t.copy_(merged[name])
        return full

    # ---- partitioning ------------------------------------------------------------------
    def _partition(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                   autocast: Autocast = ()) -> None:
        """Trace on one microbatch's model inputs, plan, then build; same on every rank.

        Planning is ``smp_fx.runtime.planning.planning``; placing the stages and applying the
        parallelisms in their order is ``smp_fx.parallel.build.parallelize``. Then the
        optimizers bind and the post-partition hooks run.

        ``autocast`` is the step function's autocast at its ``model(...)`` call: shapes and
        costs are taken under it, so the plan counts the bytes the stages will hold."""
        st = state.get()
        initialize = pretrained_files(self.get_module()) is None  # else: loaded per stage
        if not multi_process(st) and is_delayed(self.get_module()):
            # every stage lives in this process: materialise the whole model once, which
            # keeps tied parameters tied (one Parameter shared by the stages)
            (materialize if initialize else allocate)(self.get_module(), st.device)
        with context.tracing():
            gm, self.plan, self.tp_plan = plan_stages(
                self.get_module(), args, kwargs, self.options.trace_execution_times,
                self.options.trace_memory_usage, autocast, st)
        self._parallelized = parallelize(gm, self.plan, self.tp_plan, self.canonical_names,
                                         self.options, st, self._early_dp, initialize,
                                         self.expert_names)
        self._early_dp = None
        if self._parallelized.sharded is not None:
            ds_view.attach_partitioned(self.get_module().named_parameters(),
                                       self.local_named_parameters(), *ds_view.coords(st))
        binding = self._parallelized.binding()
        for opt in self._optimizers:
            opt.bind(binding)
        for hook in list(self._hooks.values()):
            n = len(inspect.signature(hook).parameters)
            first = self._optimizers[0] if self._optimizers else None
            hook(*(self, first)[:n])

    def schedule(self, num_microbatches: int, forward_only: bool) -> sched.Schedule:
        cfg = state.get().config
        placement = self.plan.placement or None if self.plan is not None else None
        return cached_schedule(cfg.pipeline, cfg.pipeline_parallel_degree, num_microbatches,
                               cfg.active_microbatches, forward_only,
                               cfg.virtual_pipeline_degree, placement)

