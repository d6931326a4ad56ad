"""A model trained and timed with ``smp.step``: the runtime's own costs exist only there.
Each run plans for the spec being calibrated, so it is priced as the fits price it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from cost_model import microbench
from cost_model.device import DeviceSpec
from cost_model.errors import SMPInternalError
from passes.plan import PartitionPlan
from smp_fx.calibration.reference import BATCH, SEQ, TINY_BATCH, VOCAB, Reference, tiny
from smp_fx.model import DistributedModel
from smp_fx.optimizer import DistributedOptimizer
from smp_fx.step import step
from smp_fx.world import comm, state
from smp_fx.world.init import init

WARM_UP = 3
"""Untimed steps before the timed ones."""


class Timed(NamedTuple):
    """Medians of the timed steps (seconds): the ``smp.step`` function, and the Adam step
    after it (NaN when none ran); and the plan they ran."""

    step_s: float
    optimizer_s: float
    plan: PartitionPlan


@contextlib.contextmanager
def initialized(stages: int, microbatches: int) -> Iterator[None]:
    """``smp.init`` for one run (interleaved pipeline of ``stages``), its state and groups
    forgotten after it: the calibration runs several configurations in one process, as
    tests do (``state._reset`` is the one way to undo ``smp.init``)."""
    init({"pipeline_parallel_degree": stages, "microbatches": microbatches,
          "pipeline": "interleaved"})
    try:
        yield
    finally:
        state._reset()


@contextlib.contextmanager
def replicas_apart() -> Iterator[None]:
    """Every process trains its own one-stage replica on purpose (dp = the process count,
    no ddp): the runtime's warnings about that are silenced."""
    ddp_log = logging.getLogger("smp_fx.parallel.ddp")
    level = ddp_log.level
    ddp_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*'ddp' is false.*")
            yield
    finally:
        ddp_log.setLevel(level)


def time_steps(spec: DeviceSpec, device: torch.device, steps: int, *, alone: bool = False,
               reference: bool = False, optimizer: bool = False) -> Timed:
    """``steps`` timed ``smp.step`` steps (after ``WARM_UP``) on ``tiny``, or with
    ``reference`` the reference transformer, on every rank, and with ``optimizer`` an
    Adam step after each; ``alone``: only rank 0 runs the timed steps (the others' times
    are NaN). Inside ``initialized``."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec.to_json()), encoding="utf-8")
        old = os.environ.get("SMP_FX_DEVICE_SPEC")
        os.environ["SMP_FX_DEVICE_SPEC"] = str(path)  # plan for what was just measured
        try:
            module = (Reference() if reference else tiny(comm.pp_size())).to(device)
            adam = DistributedOptimizer(torch.optim.Adam(module.parameters(), lr=1e-4))
            model = DistributedModel(module)
            if reference:
                x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
                y = x
            else:
                x = torch.randn(TINY_BATCH, 16, device=device)
                y = torch.randint(0, 4, (TINY_BATCH,), device=device)

            @step
            def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
                out = model(x)  # the reference's loss: the mean, nearly free and unpriced
                loss = out.mean() if reference else F.cross_entropy(out, y)
                model.backward(loss)
                return loss

            train_step(model, x, y)  # plans: the first step traces and partitions
        finally:
            if old is None:
                os.environ.pop("SMP_FX_DEVICE_SPEC", None)
            else:
                os.environ["SMP_FX_DEVICE_SPEC"] = old
    plan = model.plan
    if plan is None:
        raise SMPInternalError.build("the first smp.step plans the model", None,
                                     "smp-fx calibrate (runtime runs)", "report this bug")
    # one stage: the process's CPU time (steady under other load); several: the wall time,
    # which holds the waits for the other stage that the simulator models
    now = microbench.clock(device) if comm.pp_size() == 1 else time.perf_counter
    watch = model.executor.stragglers
    if alone and watch is not None:  # rank 0 steps by itself: an exchange would wait
        watch.stop()
    if alone and comm.rank() != 0:
        comm.barrier()
        return Timed(float("nan"), float("nan"), plan)
    times: list[float] = []
    adam_times: list[float] = []
    for i in range(steps + WARM_UP):
        if not alone:
            comm.barrier()
        adam.zero_grad()
        t0 = now()
        train_step(model, x, y)
        _finish(device)
        t1 = now()
        if optimizer:
            adam.step()
            _finish(device)
        if i >= WARM_UP:
            times.append(t1 - t0)
            adam_times.append(now() - t1)
    comm.barrier()
    return Timed(statistics.median(times),
                 statistics.median(adam_times) if optimizer else float("nan"), plan)


def _finish(device: torch.device) -> None:
    """Wait for the device's queued work (a step's kernels done, not only queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
