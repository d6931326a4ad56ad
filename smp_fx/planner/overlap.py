"""Communication as Megatron-Core overlaps it, for pricing runs made with Megatron-Core.

smp-fx's runtime exposes tensor-parallel collectives, reduces gradients from the last
backward and hands the model's outputs to every pipeline rank (``smp_fx.planner.step``).
Megatron-Core (``--tp-comm-overlap --overlap-grad-reduce --overlap-param-gather`` and
its distributed optimizer) does less in the open; these functions price its step, each
assumption named in docs/planning.md, 'Megatron-Core's overlaps'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cost_model.errors import SMPConfigError
from cost_model.memory import MemoryPerGPU, state_bytes
from cost_model.schedule_cost import RankTimes

SMP_FX = "smp-fx"
MEGATRON_CORE = "megatron-core"
MEGATRON_LM = "megatron-lm"
"""Megatron-LM as its SC'21 and 2022 papers ran it: priced as smp-fx's runtime (op by op,
its overlaps), but for the activations a sequence-parallel linear keeps: the 1/t chunk
it gathers again in backward, as Megatron does (``smp_fx.planner.fused.gathered_surplus``),
not the gathered sequence smp-fx's linear saves."""
RUNTIMES = (SMP_FX, MEGATRON_CORE, MEGATRON_LM)
"""Whose runtime a plan is priced as (``Setting.runtime``)."""


def megatron_bucket_elems(dp: int) -> int:
    """Megatron-Core's default gradient bucket: max(40M, 1M x dp) elements
    (megatron/core/distributed/distributed_data_parallel.py, core_r0.8.0)."""
    return max(40_000_000, 1_000_000 * dp)


def hide_tp(times: Sequence[RankTimes], tp_s: Sequence[float]) -> tuple[RankTimes, ...]:
    """Each rank's times with its tensor-parallel collectives run beside its GEMMs
    (``--tp-comm-overlap``): per microbatch max(compute, communication), not their sum."""
    out = []
    for t, comm in zip(times, tp_s):
        total = t.total_s
        if total <= 0 or comm <= 0:
            out.append(t)
            continue
        scale = max(total - comm, comm) / total
        out.append(RankTimes(t.fwd_s * scale, t.bwd_s * scale, t.wgrad_s * scale))
    return tuple(out)


def overlapped(comm: float, beside: float, bucket_share: float) -> float:
    """What a bucketed collective of ``comm`` seconds leaves exposed when it runs beside
    ``beside`` seconds of compute: the rest, and never less than its last bucket."""
    return max(comm - beside, comm * min(1.0, bucket_share))


GRADS = ("fp32", "bf16")
"""The dtype of Megatron-Core's gradient buffer and its reduction under bf16: fp32, its
default, or bf16 (NeMo's ``distributed_fused_adam`` with ``grad_sync_dtype: bf16``)."""


def megatron_precision(precision: str, grads: str = "fp32") -> str:
    """The state Megatron-Core keeps at a precision: bf16 weights with fp32 main gradients
    (bf16 ones with ``grads="bf16"``) and fp32 masters (``cost_model.memory.STATE``);
    fp16 and fp32 as smp-fx keeps them."""
    if grads not in GRADS:
        raise SMPConfigError.build(f"Megatron-Core's gradients are one of {GRADS}", grads,
                                   "megatron_grads", "use fp32 (its default) or bf16")
    if precision != "bf16":
        return precision
    return "nemo_bf16" if grads == "bf16" else "megatron_bf16"


def megatron_memory(dp: int, zero: str, elems: int, precision: str,
                    mem: MemoryPerGPU, cp: int = 1, outputs: int | None = None
                    ) -> MemoryPerGPU:
    """``mem`` without DDP's bucket copy of the gradients (buckets are views of the main
    gradients), its distributed optimizer (``zero1``) sharding masters and moments over
    dp x cp (``get_megatron_optimizer`` hands it ``intra_dp_cp_group``: Megatron-LM
    d98e8a6, megatron/core/optimizer/__init__.py), holding ``outputs`` bytes of logits."""
    if outputs is not None:
        mem = dataclasses.replace(mem, outputs=outputs)
    if zero == "zero1" and cp > 1:
        mem = dataclasses.replace(mem, optimizer=-(-mem.optimizer // cp))
    if dp <= 1 or zero == "fsdp":
        return mem
    copy = elems * state_bytes(megatron_precision(precision)).grad
    return dataclasses.replace(mem, buffers=max(0, mem.buffers - copy))


def megatron_logits(output_bytes: int, tp: int, cp: int, last: bool) -> int:
    """The logits Megatron-Core holds on a rank: on the last stage only (the loss is
    computed there), split over the vocabulary (tp) and the sequence (cp), with the
    cross entropy's copy of them."""
    return 2 * output_bytes // (tp * cp) if last else 0


__all__ = ["GRADS", "MEGATRON_CORE", "MEGATRON_LM", "RUNTIMES", "SMP_FX", "hide_tp",
           "megatron_bucket_elems", "megatron_logits", "megatron_memory", "megatron_precision",
           "overlapped"]
