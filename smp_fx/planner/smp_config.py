"""A cluster plan as the SMP configuration that runs it, asked of the runtime's validation.

Why here: the planner (``smp_fx.planner``) knows plans, not SMP's parameters; this module
knows both. ``candidate_config`` maps a candidate onto SMP's keys (``smp-fx plan
--emit-config``); ``refusal`` asks ``smp_fx.config.validate``, the checks ``smp.init``
makes on that many processes, whether it runs: one source of truth, so the search keeps to
what the runtime runs with no list here to keep in step (a combination the runtime learns
is searched as soon as its validation accepts it).

The configuration: degrees, ``microbatches``, ``pipeline``, ``virtual_pipeline_degree``,
``ddp`` (any data or tensor parallelism), ``prescaled_batch`` at tp > 1 (the planner
prices Megatron's semantics: the tp ranks share the batch; feed every rank of a tp group
the same samples), ``optimize`` (``memory`` turns on sequence parallelism at tp > 1),
``recompute_granularity`` (``selective``: every attention core recomputed),
``auto_partition`` false past one stage (the script pins each layer to the pipeline rank
the plan gives it, ``layers_per_rank``, with ``smp.set_partition``: the stages run are the
stages priced), ``shard_optimizer_state`` (``zero1``), ``sharded_data_parallel_degree``
(``fsdp``, with ``sdp_gradient_clipping`` 0: SMP clips the gradients' norm to 1.0 by
default there, which would make the sharded run train differently from the unsharded one)
``expert_parallel_degree``, ``context_parallel_degree`` and ``fp16``. bf16 is autocast in
the step function and full recomputation
``smp.set_activation_checkpointing`` on each layer: SMP has no configuration key for
either, so ``script_notes`` says what the script does.
"""

from __future__ import annotations

import functools
from typing import Any

from cost_model.errors import SMPError, first_line
from smp_fx.config import validate
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.result import PlanRecord


def candidate_config(c: Candidate, microbatches: int, precision: str) -> dict[str, Any]:
    """SMP's keys for ``c`` at ``microbatches`` per step (module docstring)."""
    cfg: dict[str, Any] = {
        "pipeline_parallel_degree": c.pp, "tensor_parallel_degree": c.tp,
        "microbatches": microbatches, "pipeline": c.schedule if c.pp > 1 else "interleaved",
        "ddp": c.dp > 1 or c.tp > 1 or c.cp > 1, "optimize": "memory" if c.sp else "speed",
    }
    if c.pp > 1:  # the plan's stages: its layers pinned to ranks by the script
        cfg["auto_partition"] = False
        cfg["default_partition"] = 0
    if c.vp > 1:
        cfg["virtual_pipeline_degree"] = c.vp
    if c.tp > 1:
        cfg["prescaled_batch"] = True
    if c.recompute == "selective":
        cfg["recompute_granularity"] = "selective"
    if c.zero == "zero1":
        cfg["shard_optimizer_state"] = True
    if c.zero == "fsdp":
        cfg["sharded_data_parallel_degree"] = c.dp
        cfg["sdp_gradient_clipping"] = 0.0  # SMP clips at 1.0 there; the plan changes no math
    if c.ep > 1:
        cfg["expert_parallel_degree"] = c.ep
    if c.cp > 1:
        cfg["context_parallel_degree"] = c.cp
    if precision == "fp16":
        cfg["fp16"] = True
    return cfg


def refusal(c: Candidate, global_batch: int, precision: str) -> str | None:
    """Why ``smp.init`` refuses ``c``'s configuration on ``c.gpus`` processes (its rule, in
    its own words), or None when it runs."""
    cfg = candidate_config(c, c.microbatches(global_batch), precision)
    return config_refusal(tuple(cfg.items()), c.gpus)


@functools.lru_cache(maxsize=65536)
def config_refusal(items: tuple[tuple[str, Any], ...], gpus: int) -> str | None:
    """``smp_fx.config.validate``'s verdict on a configuration (its items as
    ``candidate_config`` orders them), once each: candidates that differ only in what
    SMP's keys do not hold (full recompute is the script's) share it (a third of the
    validations of a search at ep or cp > 1)."""
    try:
        validate(dict(items), gpus)
    except SMPError as exc:
        return first_line(exc)
    return None


def smp_config(rec: PlanRecord, precision: str) -> dict[str, Any]:
    """The SMP configuration of a plan, validated as ``smp.init`` would on
    ``tp x pp x cp x dp`` processes (its error, naming the rule, when it would not run)."""
    cfg = candidate_config(rec.candidate, rec.microbatches, precision)
    validate(dict(cfg), rec.candidate.gpus)
    return cfg


def script_notes(rec: PlanRecord, precision: str, layer_path: str) -> list[str]:
    """What the training script does that the configuration cannot say."""
    notes = []
    if rec.pp > 1:
        per_rank = list(rec.details.get("layers_per_rank", []))
        notes.append(f"pin the layers ({layer_path or 'the repeated layers'}) to pipeline "
                     f"ranks with smp.set_partition, {per_rank} layers per rank in order, "
                     "the modules after them to the last rank (examples/train_planned.py "
                     "--plan PLAN.json does)")
    if rec.recompute == "full":
        notes.append(f"recompute full: smp.set_activation_checkpointing(m) on each layer "
                     f"({layer_path or 'the repeated layers'})")
    if precision == "bf16":
        notes.append("bf16: run the step function under torch.autocast(device, "
                     "torch.bfloat16)")
    if rec.tp > 1:
        notes.append("tensor parallelism: smp.set_tensor_parallelism(model) (the planner "
                     "shards the whole model); give every rank of a tp group the same "
                     "batch (prescaled_batch), sharded by smp.rdp_rank()")
    return notes


__all__ = ["candidate_config", "config_refusal", "refusal", "script_notes", "smp_config"]
