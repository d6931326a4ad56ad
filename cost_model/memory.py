"""Memory per GPU of a plan: model state by precision and sharding, activations in flight.

Why: a plan that does not fit is worthless however fast it is predicted to be, and what
fits is set by smp-fx's runtime, not by a textbook: its precision modes keep different
copies of each parameter, its data parallelism holds bucket buffers, its pipeline sends
the model's outputs to every rank. Bytes per trainable parameter element (``STATE``):

===========  =====  =====  ======================  ===========  ==============================
mode         param  grad   master (weights+grads)  Adam (m, v)  as smp-fx runs it
===========  =====  =====  ======================  ===========  ==============================
bf16         4      4      0                       8            autocast over fp32 parameters
                                                                (docs/precision.md)
fp16         2      2      8                       8            ``fp16: true``: half model,
                                                                fp32 masters and unscaled
                                                                master grads
bf16_params  2      2      8                       8            ``bf16: true``: the same in
                                                                bf16
fp32         4      4      0                       8            plain
===========  =====  =====  ======================  ===========  ==============================

Adam's moments scale with the optimizer's state per parameter (``optimizer_factor``: 2 for
Adam, 1 for momentum SGD). ``model_state`` is the one count of these bytes: the planner,
the partition plan (``passes.plan``) and the runtime's measured tensors agree on it (tests).
``zero1`` (``shard_optimizer_state``) divides masters and Adam state by the data-parallel
degree (Adam's per-tensor step counters, 4 bytes each, count too); ``fsdp``
(``sharded_data_parallel_degree`` = dp) divides everything but the tensors below SMP's
``sdp_param_persistence_threshold`` (``whole``: kept on every rank) and gathers
two layers' parameters at a time (FSDP2 prefetches one unit ahead). Expert parallelism
(``ep``) keeps 1/ep of the ``experts`` elements, their state sharded over the dp / ep
ranks holding the same experts (under ``fsdp`` the slices too, gathered whole with their
gradients for the step, as the runtime's root unit holds them);
context parallelism (``cp``) keeps 1/cp of each
microbatch's activations (the sequence is split) and the rest of the keys and values its
attentions gathered (``gathered``: their bytes at the whole sequence). Activations are the
bytes a microbatch keeps on the rank (``smp_fx.planner.profile``) times the microbatches
the schedule holds in flight there (``cost_model.schedule_cost.in_flight_at``), plus the
largest recompute transient. Buffers: DDP's gradient buckets (a copy of the gradients:
``gradient_as_bucket_view`` is off by default), two frames per pipeline channel, and the
model's outputs, which smp-fx hands to the step function on every pipeline rank (with the
loss's log-softmax of them), whole under context parallelism unless they stay the rank's
tokens (``local_outputs``: a loss inside the model, or ``context_parallel_local_outputs``;
then 1/cp of them). The cluster's reserve and allocator margin are taken off the
GPU's memory before comparing (``ClusterSpec.usable_memory_bytes``).

The peak is the larger of two moments: the forward and backward (all of the above), and
the optimizer's step, when activations are gone but the step's own temporaries are not.
torch's Adam steps with its ``foreach`` implementation by default on CUDA, which computes
the square root of every second moment it steps at once: a float32 temporary as large as
the parameters it steps (``step_temporary``; apex's and torch's fused Adam make none).
Measured on one H200, a 1.3B GPT (bf16 autocast, full recompute, batch 8): 24.54 GiB at
the step against 22.42 GiB predicted for the forward and backward, 24.46 GiB with the
step's temporary (``benchmarks/plan_gpu.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cost_model.errors import SMPConfigError

ZERO = ("none", "zero1", "fsdp")
PRECISIONS = ("bf16", "fp16", "fp32")
"""What the planner searches at (``--precision``)."""
STATE_MODES = (*PRECISIONS, "bf16_params")
"""What the state model knows: the precisions and SMP's ``bf16: true`` (bf16 weights)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per trainable parameter element, and per element of the reduced gradient."""

    param: int
    grad: int
    master: int
    optimizer: int
    reduce: int


STEP_BYTES = 4
"""torch's Adam keeps a float32 step counter per parameter tensor."""
STATE = {"bf16": StateBytes(4, 4, 0, 8, 4), "fp16": StateBytes(2, 2, 8, 8, 2),
         "fp32": StateBytes(4, 4, 0, 8, 4), "bf16_params": StateBytes(2, 2, 8, 8, 2),
         "megatron_bf16": StateBytes(2, 4, 4, 8, 4), "nemo_bf16": StateBytes(2, 2, 4, 8, 2)}
"""``megatron_bf16``: Megatron-Core's bf16 (bf16 weights, fp32 main gradients reduced in
fp32, fp32 master weights; ``smp_fx.planner.overlap``). ``nemo_bf16``: NeMo's
``distributed_fused_adam`` with ``grad_sync_dtype: bf16`` and ``contiguous_grad_buffer``
(a bf16 gradient buffer reduced in bf16; fp32 masters and moments sharded)."""


def state_bytes(precision: str) -> StateBytes:
    if precision not in STATE:
        raise SMPConfigError.build("precision is one of " + ", ".join(STATE_MODES), precision,
                                   "--precision", "use bf16, fp16 or fp32")
    return STATE[precision]


def precision_of(fp16: bool, bf16: bool) -> str:
    """The state mode of SMP's precision flags (``fp16``, ``bf16``; neither: fp32)."""
    return "fp16" if fp16 else "bf16_params" if bf16 else "fp32"


@dataclass(frozen=True)
class ModelState:
    """Bytes of parameters, gradients and optimizer state (masters included) on one rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@functools.lru_cache(maxsize=65536)
def model_state(elems: int, *, precision: str, zero: str = "none", dp: int = 1,
                tensors: int = 0, whole: int = 0, optimizer_factor: float = 2.0
                ) -> ModelState:
    """One rank's model state for ``elems`` trainable elements in ``tensors`` tensors
    (module docstring): ``zero`` shards it over ``dp`` ranks; under ``fsdp`` ``whole``
    elements (tensors below the persistence threshold) stay on every rank. Kept per
    arguments: a plan search asks for the same few hundred thousands of times.

    >>> model_state(10, precision="fp16", zero="zero1", dp=2, tensors=2)
    ModelState(params=20, grads=20, optimizer=84)
    """
    if zero not in ZERO:
        raise SMPConfigError.build("zero is one of " + ", ".join(ZERO), zero, "--fix zero",
                                   "use none, zero1 or fsdp")
    s = state_bytes(precision)
    per_opt = s.master + s.optimizer * optimizer_factor / 2.0
    params, grads = elems * s.param, elems * s.grad
    optimizer = int(round(elems * per_opt)) + STEP_BYTES * tensors
    if zero == "zero1" and dp > 1:
        optimizer = -(-optimizer // dp)
    if zero == "fsdp" and dp > 1:
        part = min(whole, elems)
        params = part * s.param + -(-(elems - part) * s.param // dp)
        grads = part * s.grad + -(-(elems - part) * s.grad // dp)
        optimizer = int(round(part * per_opt)) + STEP_BYTES * tensors \
            + -(-int(round((elems - part) * per_opt)) // dp)
    return ModelState(int(params), int(grads), int(optimizer))


@dataclass(frozen=True)
class MemoryPerGPU:
    """Bytes one GPU holds at its peak (module docstring); ``total`` sums them."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    buffers: int
    outputs: int
    step_temporary: int = 0
    """The optimizer step's temporaries (module docstring), held when activations are not."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def training(self) -> int:
        """The forward and backward's peak."""
        return (self.params + self.grads + self.optimizer + self.activations + self.transient
                + self.buffers + self.outputs)

    @property
    def stepping(self) -> int:
        """The optimizer step's peak."""
        return self.state + self.buffers + self.step_temporary

    @property
    def total(self) -> int:
        return max(self.training, self.stepping)

    def to_json(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "transient": self.transient,
                "buffers": self.buffers, "outputs": self.outputs,
                "step_temporary": self.step_temporary, "total": self.total}


def memory_per_gpu(*, elems: int, buffers: int, kept: int, in_flight: float, transient: int,
                   precision: str, zero: str, dp: int, layer_elems: int, boundary: int,
                   output_bytes: int, pipelined: bool, tensors: int = 0,
                   whole: int = 0, step_temporary: bool = False, experts: int = 0,
                   ep: int = 1, cp: int = 1, gathered: int = 0,
                   local_outputs: bool = False) -> MemoryPerGPU:
    """One rank's peak: ``elems`` trainable parameter elements, ``buffers`` bytes of
    buffers, ``kept`` activation bytes per microbatch held ``in_flight`` times,
    ``boundary`` the bytes of one pipeline message; ``step_temporary``: the optimizer
    makes a float32 temporary of the parameters it steps (torch's foreach Adam);
    ``experts`` of ``elems`` split over ``ep`` ranks, activations over ``cp`` (less the
    ``gathered`` keys and values, kept whole), the outputs too if ``local_outputs``.

    >>> m = memory_per_gpu(elems=10, buffers=0, kept=100, in_flight=2, transient=0,
    ...                    precision="bf16", zero="none", dp=1, layer_elems=10, boundary=0,
    ...                    output_bytes=0, pipelined=False)
    >>> m.params, m.grads, m.optimizer, m.activations, m.total
    (40, 40, 80, 200, 360)
    """
    s = state_bytes(precision)
    local_experts = -(-experts // ep)
    state = model_state(elems - experts, precision=precision, zero=zero, dp=dp,
                        tensors=tensors, whole=whole)
    if experts:
        held = model_state(local_experts, precision=precision, zero=zero, dp=dp // ep)
        state = ModelState(state.params + held.params, state.grads + held.grads,
                           state.optimizer + held.optimizer)
    elems = elems - experts + local_experts
    comm = 0
    if zero == "fsdp" and dp > 1:
        comm += 2 * layer_elems * (s.param + s.grad)  # two gathered units and their grads
        if 1 < ep < dp:  # the expert slices, gathered for the whole step
            comm += local_experts * (s.param + s.grad)
    elif dp > 1:
        comm += elems * s.grad  # DDP's bucket buffers
    if pipelined:
        comm += 2 * 2 * boundary  # a frame per channel each way
    stepped = elems * 4  # float32, as Adam's moments
    if zero != "none" and dp > 1:
        stepped = -(-stepped // dp)
    return MemoryPerGPU(state.params, state.grads, state.optimizer,
                        int(round((kept + gathered * (cp - 1)) * in_flight / cp)),
                        -(-int(transient) // cp),
                        int(comm + buffers),
                        2 * int(output_bytes) // (cp if local_outputs else 1),
                        int(stepped) if step_temporary else 0)


__all__ = ["PRECISIONS", "STATE", "STATE_MODES", "ZERO", "MemoryPerGPU", "ModelState",
           "StateBytes", "memory_per_gpu", "model_state", "precision_of", "state_bytes"]
