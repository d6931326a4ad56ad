"""``smp.write_measurement(path)``: this run's measured step, for ``smp-fx plan --measured``.

Why one call: a user's own cluster is what a plan cannot know in advance; after a few
steps of the real run, one line in the script writes what ``cost_model.refit`` needs (the
configuration in the planner's terms, the step time, each rank's time per action from the
flight record, the exposed reduction, peak memory). Collective: every rank calls it; rank
0 writes the file (``cost_model.measurement``). See docs/planning.md, 'Learning from a
measured run'.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch

from cost_model.devices import spec_for_device_name
from cost_model.errors import SMPConfigError
from cost_model.measurement import MeasuredConfig, Measurement, RankFigures
from smp_fx.marking.activation_checkpointing import is_marked
from smp_fx.world import comm, context, state

PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


def _config(model: Any, mbs: int, autocast: str) -> MeasuredConfig:
    st = state.get()
    cfg = st.config
    tp, pp, dp = comm.tp_size(), comm.pp_size(), comm.rdp_size()
    recompute = "selective" if cfg.recompute_granularity == "selective" else (
        "full" if any(is_marked(m) for m in model.get_module().modules()) else "none")
    zero = ("fsdp" if cfg.sharded_data_parallel_degree > 1 else
            "zero1" if cfg.shard_optimizer_state else "none")
    precision = "fp16" if cfg.fp16 else PRECISION.get(autocast, "bf16" if cfg.bf16 else "fp32")
    on_gpu = torch.cuda.is_available() and any(
        p.is_cuda for p in model.get_module().parameters())
    hardware = torch.cuda.get_device_name() if on_gpu else "cpu"
    device = (spec_for_device_name(hardware) or hardware) if on_gpu else "cpu"
    return MeasuredConfig(
        world=st.world_size, tp=tp, pp=pp, dp=dp, mbs=mbs, microbatches=cfg.microbatches,
        vp=cfg.virtual_pipeline_degree, schedule=cfg.pipeline, recompute=recompute,
        sp=tp > 1 and cfg.optimize == "memory", zero=zero, precision=precision,
        device=device, hardware=hardware)


def _peak_memory() -> tuple[int, str]:
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_rss"


def write_measurement(path: str | Path, skip: int = 1) -> Measurement:
    """Collective: gather every rank's figures of the steps so far (the first ``skip`` are
    warm-up) and write them to ``path`` on rank 0; returns them on every rank (smp-fx
    extension; module docstring)."""
    model = context.current_model()
    executor = getattr(model, "executor", None) if model is not None and getattr(
        model, "partitioned", False) else None
    log = getattr(executor, "step_log", None)
    if model is None or log is None:
        raise SMPConfigError.build("smp.write_measurement measures the steps of a "
                                   "DistributedModel", "no model has stepped",
                                   "smp.write_measurement", "call it after a few smp.step "
                                   "calls of the training loop")
    step_s, actions, receiving, reducing, steps = log.figures(skip)
    if steps < 1:
        raise SMPConfigError.build("smp.write_measurement needs at least skip + 2 training "
                                   "steps", len(log.steps), "smp.write_measurement",
                                   f"train {skip + 3} steps or more first (skip={skip})")
    peak, kind = _peak_memory()
    mine = RankFigures(comm.rank(), comm.pp_rank(), comm.tp_rank(), comm.rdp_rank(), step_s,
                       tuple(actions), receiving, reducing, peak, kind)
    st = state.get()
    alone = st.in_process or st.world_size == 1
    every = [mine] if alone else comm.allgather(mine, comm.WORLD)
    config = _config(model, log.mbs, log.autocast)
    out = Measurement(config, steps, max(r.step_time_s for r in every),
                      tuple(every))
    if comm.rank() == 0:
        out.save(path)
    return out


__all__ = ["write_measurement"]
