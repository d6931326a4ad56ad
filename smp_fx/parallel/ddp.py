"""Hybrid pipeline + data parallelism (``ddp: true``): one DDP wrapper per local stage.

DDP arms its reducer at forward time, but a stage runs several forwards before their
backwards, so every forward runs under ``no_sync`` and the reducer is armed by hand before
the stage's last backward of a reducing step (split backwards reduce explicitly after the
last W). ``DataParallel`` is the data-parallel step of the parallelisms' build.
See docs/runtime.md, 'Data parallelism: when the reducer is armed'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.nn.parallel import DistributedDataParallel

from cost_model.errors import SMPConfigError, SMPRuntimeError
from smp_fx.config import SMPConfig
from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.seams import StageRunner, StepHooks
from smp_fx.runtime.executor.split_backward import PendingW
from smp_fx.world import context, order_mode, state

log = logging.getLogger("smp_fx.parallel.ddp")

DDP_AROUND_MODEL = (
    "smp.DistributedModel handles data parallelism itself ('ddp': true) and must not be "
    "wrapped in torch.nn.parallel.DistributedDataParallel")
STEP_INSIDE = ("optimizer.step() must be called outside the smp.step-decorated function "
               "(gradients and their data-parallel reduction are complete only after it)")


class DataParallelOptions(Protocol):
    """The ``smp.DistributedModel`` arguments data parallelism reads."""

    @property
    def overlapping_allreduce(self) -> bool: ...
    @property
    def backward_passes_per_step(self) -> int: ...
    @property
    def bucket_cap_mb(self) -> int: ...
    @property
    def broadcast_buffers(self) -> bool: ...
    @property
    def gradient_as_bucket_view(self) -> bool: ...


# ---- misuse detection ------------------------------------------------------------------
class RejectDDPWrap:
    """Class attribute of ``DistributedModel`` named ``_ddp_params_and_buffers_to_ignore``.

    DDP reads it with ``hasattr`` before any collective, so raising ``SMPRuntimeError``
    (not an ``AttributeError``) stops the wrap clearly on every rank, without a hang."""

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        raise SMPRuntimeError.build(
            DDP_AROUND_MODEL, type(obj).__name__, "torch.nn.parallel.DistributedDataParallel",
            "pass the smp.DistributedModel itself to the smp.step function; set 'ddp': true")


def check_not_inside_step(what: str = "optimizer.step()") -> None:
    """Raise if called from inside an ``smp.step`` function (a microbatch thread)."""
    if context.turn() is not None:
        raise SMPRuntimeError.build(STEP_INSIDE, what, "inside an smp.step function",
                                    "move optimizer.step() after the smp.step call returns")


def _optimizer_step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    check_not_inside_step(f"{type(optimizer).__name__}.step()")


def guard_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """Register the inside-step check as a step pre-hook of ``optimizer`` (torch's public
    hook API), so the wrapped optimizer is caught too when stepped directly."""
    return optimizer.register_step_pre_hook(_optimizer_step_pre_hook)


# ---- explicit bucketed reduction --------------------------------------------------------
def buckets(params: Sequence[nn.Parameter], cap_mb: float) -> list[list[nn.Parameter]]:
    """Parameters in reverse order (as backward produces them) in buckets of at most
    ``cap_mb`` MiB, one dtype/device each; a larger parameter gets its own."""
    cap = max(1, int(cap_mb * 1024 * 1024))
    out: list[list[nn.Parameter]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[nn.Parameter], list[int]]] = {}
    for p in reversed([p for p in params if p.requires_grad]):
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        cur = open_.get(key)
        if cur is None or (cur[0] and cur[1][0] + nbytes > cap):
            cur = ([], [0])
            out.append(cur[0])
            open_[key] = cur
        cur[0].append(p)
        cur[1][0] += nbytes
    return out


def allreduce_grads(bucket_list: Sequence[Sequence[nn.Parameter]], group: Any, size: int,
                    zeros: bool = False) -> None:
    """Average ``.grad`` over ``group``: scale by 1/size, sum; all buckets in flight at once.
    Missing gradients and ``zeros`` (a joined rank) contribute zeros."""
    finish_allreduce(start_allreduce(bucket_list, group, size, zeros), zeros)


Reduction = list[tuple[Any, torch.Tensor, Sequence[nn.Parameter]]]
"""The buckets of one ``start_allreduce`` in flight: (work, flat buffer, parameters)."""


def start_allreduce(bucket_list: Sequence[Sequence[nn.Parameter]], group: Any, size: int,
                    zeros: bool = False) -> Reduction:
    """Launch ``allreduce_grads``'s bucket sums without waiting (``finish_allreduce``)."""
    scale = 1.0 / size
    works: Reduction = []
    for bucket in bucket_list:
        flat = torch.cat([
            torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            if zeros or p.grad is None else p.grad.detach().reshape(-1) for p in bucket])
        flat.mul_(scale)
        works.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    return works


def finish_allreduce(works: Reduction, zeros: bool = False) -> None:
    """Wait for ``start_allreduce``'s sums and write the averages into ``.grad``."""
    for work, flat, bucket in works:
        work.wait()
        if zeros:
            continue
        offset = 0
        for p in bucket:
            g = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.detach().copy_(g)


# ---- the stage runner ------------------------------------------------------------------
class DDPStageRunner(StageRunner):
    """A ``StageRunner`` calling the stage through its DDP wrapper; ``stage.module`` stays the
    plain stage GraphModule (names, optimizer, checkpoints)."""

    def __init__(self, base: StageRunner, wrapper: DistributedDataParallel,
                 dp: DataParallel) -> None:
        super().__init__(base.stage, base.device)
        self.module = wrapper
        self.input_path_params = base.input_path_params  # compiled regions' (compiled.py)
        self.deferred = base.deferred
        self.ddp = wrapper
        self.dp = dp

    def forward(self, inputs: Sequence[Any], microbatch: int) -> tuple[Any, ...]:
        with self.ddp.no_sync():
            out = tuple(self.ddp(*inputs))
        self.took(microbatch)
        return out

    def backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                 microbatch: int) -> None:
        if self.dp.arm_now(self.stage.index, microbatch):
            # what DDP's forward does when it is not under no_sync
            self.ddp.reducer.prepare_for_forward()
            self.ddp.reducer.prepare_for_backward([])
            self.dp.armed.add(self.stage.index)
        self.dp.backward_ran.add(self.stage.index)
        super().backward(tensors, grads, microbatch)

    def backward_input(self, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                       inputs: list[torch.Tensor], microbatch: int
                       ) -> tuple[list[torch.Tensor | None], PendingW]:
        """A split backward's I produces no weight gradient: nothing is armed."""
        self.dp.backward_ran.add(self.stage.index)
        return super().backward_input(tensors, grads, inputs, microbatch)

    def backward_weight(self, pending: PendingW, microbatch: int) -> None:
        """A split backward's W; after the stage's last W of a reducing step its bucketed
        all-reduce starts at once, since DDP's reducer cannot follow several autograd passes."""
        super().backward_weight(pending, microbatch)
        if self.dp.reduce_after_weight(self.stage.index, microbatch):
            self.dp.started[self.stage.index] = start_allreduce(
                self.dp.bucket_lists[self.stage.index], self.dp.group, self.dp.size)


# ---- the per-model controller ------------------------------------------------------------
class DataParallel(Joinable):
    """The data-parallel state of one partitioned ``DistributedModel`` on this rank."""

    name: ClassVar[str] = "data_parallel"

    def __init__(self, options: DataParallelOptions, group: Any, size: int,
                 device: torch.device) -> None:
        super().__init__()
        self.options = options
        self.group = group
        self.size = size
        self.device = device
        self.runners: dict[int, DDPStageRunner] = {}
        self.bucket_lists: dict[int, list[list[nn.Parameter]]] = {}
        self.training_steps = 0
        self.reduce_this_step = False
        self.last_backward: dict[int, int] = {}
        self.last_weight: dict[int, int] = {}  # a split backward's last W per stage
        self.stage_params: dict[int, list[nn.Parameter]] = {}
        self.shared_local = False  # a parameter several local stages (chunks) read
        self._bucketed_for: Any = None  # the op list the bucket lists were made for
        self.started: dict[int, Reduction] = {}  # reductions started after a stage's last W
        self.armed: set[int] = set()
        self.backward_ran: set[int] = set()
        self.reductions = 0
        self.comm_hooks: list[tuple[Any, Any]] = []
        self.ignored: set[int] = set()  # ids of parameters another rule reduces
        self.joined = False  # join() entered: ranks out of data make no steps from then on

    def ignore(self, params: Sequence[nn.Parameter]) -> None:
        """Leave ``params`` out of the reduction (and DDP's broadcast): another
        parallelism reduces them over its own group (expert slices). Before ``wrap``."""
        self.ignored.update(id(p) for p in params)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """DDP's ``register_comm_hook`` on every local stage's wrapper (now, and on those
        ``wrap`` makes later)."""
        self.comm_hooks.append((state, hook))
        for runner in self.runners.values():
            runner.ddp.register_comm_hook(state, hook)

    def wrap(self, runners: Mapping[int, StageRunner]) -> dict[int, StageRunner]:
        """The local stages' runners with each stage wrapped in DDP over the group (collective:
        DDP's constructor broadcasts the stage from dp rank 0)."""
        opts = self.options
        out: dict[int, StageRunner] = {}
        for s in sorted(runners):
            base = runners[s]
            skip = [n for n, p in base.stage.module.named_parameters() if id(p) in self.ignored]
            if not any(p.requires_grad and id(p) not in self.ignored
                       for p in base.stage.module.parameters()):
                log.info("smp-fx ddp: stage %d has no gradient for DDP to reduce (%s): not "
                         "wrapped in DDP", s, f"only parameters another rule reduces: {len(skip)}"
                         f", e.g. {skip[0]}" if skip else "no trainable parameter")
                out[s] = base
                continue
            if skip:
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    base.stage.module, skip)
            wrapper = DistributedDataParallel(
                base.module,  # the stage, or its compiled call (smp_fx.runtime.executor.compiled)
                process_group=self.group, bucket_cap_mb=opts.bucket_cap_mb,
                forward_sync_buffers=opts.broadcast_buffers,  # buffers are synced at init anyway
                gradient_as_bucket_view=opts.gradient_as_bucket_view)
            for hook_state, hook in self.comm_hooks:
                wrapper.register_comm_hook(hook_state, hook)
            runner = DDPStageRunner(base, wrapper, self)
            out[s] = self.runners[s] = runner
            self.stage_params[s] = [p for p in base.stage.module.parameters()
                                    if id(p) not in self.ignored]
            self.bucket_lists[s] = buckets(self.stage_params[s], opts.bucket_cap_mb)
        ids = [id(p) for params in self.stage_params.values() for p in params]
        self.shared_local = len(ids) != len(set(ids))
        log.info("smp-fx ddp: stages %s wrapped over an rdp group of %d (overlap=%s, bpps=%d)",
                 sorted(self.runners), self.size, opts.overlapping_allreduce,
                 opts.backward_passes_per_step)
        return out

    def hooks(self) -> StepHooks:
        """Before a step: find each stage's last backward; after it: the dp average (it
        runs before the tied pipeline sum, ``smp_fx.parallel.build.POST_STEP_ORDER``)."""
        return StepHooks(self.pre_step, self.post_step)

    def disable_join(self) -> None:
        """Later steps run outside ``join()``: nothing shadows them any more (``Join``
        leaves its configuration on the joinable)."""
        self._join_config = _JoinConfig.construct_disabled_join_config()

    def ever_joined(self) -> bool:
        """Whether ``join()`` was entered (every rank enters it at the same point), after
        which the ranks' step counts may differ."""
        return self.joined

    # executor hooks
    def pre_step(self, ops: Sequence[Op]) -> None:
        """Find each local stage's last backward action; decide whether this step reduces."""
        self.last_backward = {op.stage: op.microbatch for op in ops if op.kind == "B"}
        self.last_weight = {op.stage: op.microbatch for op in ops if op.kind == "W"}
        if self.shared_local and ops is not self._bucketed_for:
            self._own_shared(ops)
        self.armed = set()
        self.started = {}
        self.backward_ran = set()
        training = bool(self.last_backward or self.last_weight)
        work = Join.notify_join_context(self)
        if work is not None:  # inside join(): joined ranks shadow this step
            work.wait()
            self._agree_join_step(training)
        if training:
            self.training_steps += 1
        bpps = self.options.backward_passes_per_step
        self.reduce_this_step = training and self.training_steps % bpps == 0
        if self.options.broadcast_buffers:
            for r in self.runners.values():
                r.ddp.require_forward_param_sync = True

    def _own_shared(self, ops: Sequence[Op]) -> None:
        """A parameter several local stages read is reduced once, with the stage whose last
        backward comes last (reduced earlier, the later stage's gradients would be lost)."""
        last = {op.stage: i for i, op in enumerate(ops) if op.kind in ("B", "W")}
        owner: dict[int, int] = {}
        for s in sorted(self.stage_params, key=lambda s: last.get(s, -1)):
            for p in self.stage_params[s]:
                owner[id(p)] = s
        for s, params in self.stage_params.items():
            self.bucket_lists[s] = buckets([p for p in params if owner[id(p)] == s],
                                           self.options.bucket_cap_mb)
        self._bucketed_for = ops

    def arm_now(self, stage: int, microbatch: int) -> bool:
        # two DDP reducers of one parameter would each reduce it: reduce explicitly instead
        return (self.reduce_this_step and self.options.overlapping_allreduce
                and not self.shared_local and self.last_backward.get(stage) == microbatch)

    def reduce_after_weight(self, stage: int, microbatch: int) -> bool:
        return (self.reduce_this_step and self.options.overlapping_allreduce
                and self.last_weight.get(stage) == microbatch)

    def post_step(self) -> None:
        """Non-overlapping mode: reduce now. A stage whose step ran no backward at all (the
        step function never called ``model.backward``) has nothing new to reduce."""
        if not self.reduce_this_step:
            return
        self.reductions += 1
        for s in sorted(self.runners):
            if s in self.armed:
                _check_finalized(self.runners[s].ddp, s)
                continue
            if s in self.started:
                finish_allreduce(self.started.pop(s))
                continue
            if s not in self.backward_ran:
                continue
            if self.options.overlapping_allreduce and not self.shared_local:
                raise SMPRuntimeError.build(
                    "the stage's last backward of the step did not run, so its gradients "
                    "were not reduced over the data-parallel group", f"stage {s}",
                    "smp.DistributedModel (ddp)",
                    "call model.backward for every microbatch, or set "
                    "overlapping_allreduce=False")
            allreduce_grads(self.bucket_lists[s], self.group, self.size)

    # Joinable
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _StepJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.group

    def _agree_join_step(self, training: bool) -> None:
        """Tell joined ranks (which shadow this step) whether the step trains and reduces."""
        flag = torch.tensor([1.0 if training else 0.0], device=self.device)
        dist.all_reduce(flag, group=self.group)


def _check_finalized(wrapper: DistributedDataParallel, stage: int) -> None:
    """An armed reduction completes only when every parameter got a gradient in the last
    backward; otherwise some buckets stayed local (replicas would silently diverge)."""
    try:
        wrapper.reducer._check_reducer_finalized()
    except RuntimeError as exc:
        raise SMPRuntimeError.build(
            "with overlapping_allreduce, every parameter of a stage must get a gradient in "
            "the stage's last microbatch backward; some did not, so their buckets were not "
            "reduced over the data-parallel group", f"stage {stage}",
            "smp.DistributedModel (ddp)", "set overlapping_allreduce=False (parameters "
            "without a gradient then contribute zeros), or keep them on the loss path"
        ) from exc


class _StepJoinHook(JoinHook):
    """On a rank that ran out of data, once per step of the others: the same collectives as
    a step, with zero contributions."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp

    def main_hook(self) -> None:
        dp = self.dp
        if not dp.runners:
            raise SMPRuntimeError.build(
                "a rank joined before running any smp.step, so it cannot shadow the others",
                None, "DistributedModel.join", "give every data-parallel rank >= 1 batch")
        flag = torch.zeros(1, device=dp.device)
        dist.all_reduce(flag, group=dp.group)
        training = flag.item() > 0
        if training:
            dp.training_steps += 1
        reduce = training and dp.training_steps % dp.options.backward_passes_per_step == 0
        for _, r in sorted(dp.runners.items()):
            ddp = r.ddp
            if training:
                ddp.reducer._rebuild_buckets()
            if dp.options.broadcast_buffers and ddp.modules_buffers:
                ddp._sync_buffers()
        if not reduce:
            return
        for s, r in sorted(dp.runners.items()):
            if dp.options.overlapping_allreduce:
                r.ddp._match_all_reduce_for_bwd_pass()
                r.ddp.reducer._push_all_rebuilt_params()
            else:
                allreduce_grads(dp.bucket_lists[s], dp.group, dp.size, zeros=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Make every replica equal to one that saw all the data (DDP's final sync)."""
        for _, r in sorted(self.dp.runners.items()):
            r.ddp._sync_final_model(is_last_joiner)


# ---- the build's data-parallel step -------------------------------------------------------
def controller(options: DataParallelOptions, st: state.State) -> DataParallel | None:
    """A ``DataParallel`` for a model with ``options`` on this rank (``st``), or None with
    one replica (nothing to reduce). Creating it runs no collective."""
    size = st.axis_size("rdp")
    if size == 1:
        return None
    if options.backward_passes_per_step < 1:
        raise SMPConfigError.build("backward_passes_per_step must be >= 1",
                                   options.backward_passes_per_step, "smp.DistributedModel",
                                   "pass 1 (reduce every step) or more")
    return DataParallel(options, st.group("rdp"), size, st.device)


def for_build(options: DataParallelOptions, early: DataParallel | None, st: state.State
              ) -> DataParallel | None:
    """The ``DataParallel`` the build applies (``early``: the one ``join()`` made before the
    first step), or None without ``ddp`` or with a single replica."""
    if not st.config.ddp:
        if st.axis_size("rdp") > 1:
            log.warning("smp-fx: %d data-parallel replicas but 'ddp' is false: their "
                        "gradients are not reduced, so the replicas train independently; "
                        "set 'ddp': true for data parallelism", st.axis_size("rdp"))
        return None
    return early if early is not None else controller(options, st)


def check_comm_hook(options: DataParallelOptions, cfg: SMPConfig) -> None:
    """``DistributedModel.register_comm_hook`` needs DDP's overlapped reduction (SMP's
    rule): ``ddp`` and ``overlapping_allreduce``, and no sharded data parallelism."""
    if not cfg.ddp or not options.overlapping_allreduce:
        raise SMPConfigError.build(
            "register_comm_hook needs 'ddp': true and overlapping_allreduce=True",
            {"ddp": cfg.ddp, "overlapping_allreduce": options.overlapping_allreduce},
            "DistributedModel.register_comm_hook", "set both, or reduce by hand after the step")
    if cfg.sharded_data_parallel_degree > 1:
        raise SMPConfigError.build(
            "register_comm_hook hooks DDP, which sharded data parallelism does not use",
            cfg.sharded_data_parallel_degree, "DistributedModel.register_comm_hook",
            "use sharded_data_parallel_degree 1 to hook the gradient reduction")


def check_join(cfg: SMPConfig) -> None:
    """``DistributedModel.join()`` needs ``ddp``."""
    if not cfg.ddp:
        raise SMPConfigError.build("DistributedModel.join() is supported only with ddp",
                                   False, "ddp", "set 'ddp': true in the smp config")


@contextmanager
def join(dp: DataParallel | None, throw_on_early_termination: bool = False
         ) -> Iterator[None]:
    """``DistributedModel.join()``: train with uneven numbers of batches across replicas.

    Every rank runs one step inside (or before) it; ``dp`` None: nothing can be uneven."""
    if dp is None:
        yield
        return
    dp.joined = True  # no more exchanges at step boundaries: step counts may differ
    try:
        with order_mode.paused("DistributedModel.join()"), \
                Join([dp], throw_on_early_termination=throw_on_early_termination):
            yield
    finally:
        dp.disable_join()
