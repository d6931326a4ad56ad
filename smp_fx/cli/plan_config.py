"""A cluster plan as the SMP configuration that runs it, and what the runtime cannot run yet.

Why here: the planner (``passes.cluster``) knows plans, not SMP's parameters; this module
knows both. ``smp_config`` maps a ``PlanRecord`` onto SMP's keys (``smp-fx plan
--emit-config``), checked by ``smp.init``'s own validation; ``runtime_refusal`` says why
the runtime cannot run a candidate today, read from the runtime's own configuration table
(``smp_fx.config``), so a schedule or a key another change adds is accepted as soon as it
exists:

- ``pipeline`` must be one of the configuration's choices (``simple``, ``interleaved``
  today; ``zero_bubble`` and ``zbv`` once the schedules issue lands);
- v > 1 needs the ``virtual_pipeline_degree`` key;
- ``selective`` recomputation needs a module around the attention core, which the runtime
  checkpoints by module only (``smp.set_activation_checkpointing``);
- sharding (``zero1``, ``fsdp``) with tensor parallelism, and ``fp16`` with ``fsdp``, are
  not built.

The configuration: degrees, ``microbatches``, ``pipeline``, ``ddp`` (any data or tensor
parallelism), ``prescaled_batch`` at tp > 1 (the planner prices Megatron's semantics: the
tp ranks share the batch; feed every rank of a tp group the same samples), ``optimize``
(``memory`` turns on sequence parallelism at tp > 1), ``auto_partition`` false past one
stage (the script pins each layer to the pipeline rank the plan gives it,
``layers_per_rank``, with ``smp.set_partition``: the stages run are the stages priced),
``shard_optimizer_state`` (``zero1``),
``sharded_data_parallel_degree`` (``fsdp``, with ``sdp_gradient_clipping`` 0: SMP clips
the gradients' norm to 1.0 by default there, which would make the sharded run train
differently from the unsharded one) and ``fp16``. bf16 is autocast in the step
function and full recomputation ``smp.set_activation_checkpointing`` on each layer: SMP
has no configuration key for either, so ``script_notes`` says what the script does.
"""

from __future__ import annotations

from typing import Any

from passes.cluster.candidate import Candidate
from passes.cluster.result import PlanRecord
from smp_fx.config import PARAMS, load_config, resolve_topology


def _param(name: str) -> Any:
    return next((p for p in PARAMS if p.name == name), None)


def runtime_refusal(c: Candidate, precision: str) -> str | None:
    """Why smp-fx's runtime cannot run ``c`` yet (module docstring), or None."""
    pipeline = _param("pipeline")
    if c.pp > 1 and pipeline is not None and c.schedule not in pipeline.choices:
        return f"the runtime has no {c.schedule!r} schedule yet"
    if c.vp > 1 and _param("virtual_pipeline_degree") is None:
        return "the runtime has no virtual stages (virtual_pipeline_degree) yet"
    if c.recompute == "selective":
        return ("the runtime checkpoints modules; selective recomputation needs the "
                "attention core as a module")
    if c.zero != "none" and c.tp > 1:
        return f"{c.zero} with tensor parallelism is not built in smp-fx"
    if c.zero == "fsdp" and precision == "fp16":
        return "fp16 with fsdp is not built in smp-fx (bf16 autocast is)"
    return None


def smp_config(rec: PlanRecord, precision: str) -> dict[str, Any]:
    """The SMP configuration of a plan, validated as ``smp.init`` would on
    ``tp x pp x dp`` processes (module docstring)."""
    c = rec.candidate
    why = runtime_refusal(c, precision)
    if why is not None:
        from cost_model.errors import SMPConfigError

        raise SMPConfigError.build("--emit-config writes only what the runtime can run", why,
                                   f"plan {c.label()}",
                                   "plan with --emit-config (it searches only runnable "
                                   "plans) or --fix a runnable schedule / recompute")
    cfg: dict[str, Any] = {
        "pipeline_parallel_degree": c.pp, "tensor_parallel_degree": c.tp,
        "microbatches": rec.microbatches, "pipeline": c.schedule if c.pp > 1 else "interleaved",
        "ddp": c.dp > 1 or c.tp > 1, "optimize": "memory" if c.sp else "speed",
    }
    if c.pp > 1:  # the plan's stages: its layers pinned to ranks by the script
        cfg["auto_partition"] = False
        cfg["default_partition"] = 0
    if c.vp > 1:
        cfg["virtual_pipeline_degree"] = c.vp
    if c.tp > 1:
        cfg["prescaled_batch"] = True
    if c.zero == "zero1":
        cfg["shard_optimizer_state"] = True
    if c.zero == "fsdp":
        cfg["sharded_data_parallel_degree"] = c.dp
        cfg["sdp_gradient_clipping"] = 0.0  # SMP clips at 1.0 there; the plan changes no math
    if precision == "fp16":
        cfg["fp16"] = True
    config = load_config(dict(cfg), env={})
    resolve_topology(config, c.gpus)
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


__all__ = ["runtime_refusal", "script_notes", "smp_config"]
