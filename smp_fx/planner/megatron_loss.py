"""Megatron-Core's loss on the last pipeline stage: the vocabulary's cross entropy in fp32.

Megatron-Core computes the loss inside the model, on the rank holding the last chunk, over
its tensor-parallel slice of the logits. Its cross entropy (core_r0.8.0,
``megatron/core/tensor_parallel/cross_entropy.py``; ``--cross-entropy-loss-fusion`` is off
by default) is a chain of separate kernels over tokens x vocabulary / tp elements: at a
131072-token vocabulary they move about as many bytes as the rest of a small model's
layers do, a cost the graph (which ends at the logits) does not hold.
"""

from __future__ import annotations

from cost_model.device import DeviceSpec

FP32 = 4


def loss_bytes(elements: int, element_size: int) -> tuple[int, int]:
    """(forward, backward) bytes moved over ``elements`` logits of ``element_size`` bytes,
    kernel by kernel as ``_VocabParallelCrossEntropy`` runs them (module docstring)."""
    cast = element_size + FP32 if element_size != FP32 else 0  # .float(), and back in bwd
    forward = (cast            # vocab_parallel_logits.float()
               + FP32          # torch.max(dim=-1)
               + 2 * FP32      # logits -= logits_max (in place)
               + 2 * FP32      # torch.exp(out=)
               + FP32          # exp_logits.sum(dim=-1)
               + 2 * FP32)     # exp_logits.div_(sum): the softmax kept for backward
    backward = (2 * FP32       # grad_input.mul_(grad_output)
                + cast)        # autograd casts the float32 gradient to the logits' dtype
    return elements * forward, elements * backward


def loss_times(output_bytes: int, element_size: int, tp: int,
               spec: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch's loss on a rank holding 1/tp of
    ``output_bytes`` of logits, at the bandwidth one float32 pass over them reaches."""
    elements = output_bytes // element_size // tp
    if elements <= 0:
        return 0.0, 0.0
    rate = spec.bandwidth(float(elements * FP32))
    fwd, bwd = loss_bytes(elements, element_size)
    return fwd / rate, bwd / rate


__all__ = ["loss_bytes", "loss_times"]
