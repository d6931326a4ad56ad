"""The rounded datasheet specs of the H100, A100 and V100: the estimates the golden plans
are made with (``smp-fx calibrate`` measures a GPU; ``cost_model.gpu_specs`` holds the
sourced specs the built-in clusters carry).

They sit below both the sourced specs, which start from them, and ``cost_model.devices``,
which finds every spec by name.
"""

from __future__ import annotations

from cost_model.calibrate import NO_WAVES
from cost_model.device import GB, DeviceSpec, GiB, OpOverheads, Table

_DATASHEET = {
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
    "v100": "NVIDIA V100 Tensor Core GPU datasheet (SXM2 32GB)",
}
# Rounded estimates, the same for the three GPUs; `smp-fx calibrate` on the GPU measures them.
_GPU_MATMUL: Table = ((16.0, 0.03), (64.0, 0.15), (256.0, 0.5), (1024.0, 0.8), (4096.0, 0.9))
_GPU_ELEMENTWISE: Table = ((1e5, 0.1), (1e7, 0.6), (1e8, 0.85))
_GPU_OPS: OpOverheads = (
    ("default", 11e-6, 15e-6), ("module", 3e-6, 0.0), ("view", 3.5e-6, 7e-6),
    ("linear", 20e-6, 90e-6), ("matmul", 15e-6, 60e-6), ("bmm", 18e-6, 60e-6),
    ("conv", 18e-6, 47e-6), ("layer_norm", 19e-6, 50e-6), ("batch_norm", 27e-6, 56e-6),
    ("embedding", 12e-6, 54e-6), ("softmax", 11.5e-6, 23e-6), ("sdpa", 20e-6, 80e-6),
    ("gelu", 9.5e-6, 17e-6), ("relu", 10.5e-6, 17e-6), ("tanh", 9.5e-6, 18e-6))
_GPU_OVERHEAD_SCALE = 1.5
_H100_HOST = ("measured by smp-fx calibrate on an H100 80GB HBM3 machine (torch 2.11+cu130, "
              "one process; the mean of two runs, 2026-11-26, rounded); host time, so a "
              "faster or slower host CPU moves it, and the other GPUs get the H100's")
_GPU_SOURCES = {
    "matmul_efficiency": "estimate, after the GEMM throughput-versus-size curves of NVIDIA's "
                         "'Matrix Multiplication Background User's Guide'; not measured",
    "elementwise_efficiency": "estimate: small kernels are launch-bound, large streaming "
                              "kernels reach about 85-90% of HBM peak; not measured",
    "op_overheads": f"{_H100_HOST}: eager PyTorch's launch, dispatch and autograd "
                    "bookkeeping per op, which bounds small models' steps",
    "overhead_scale": f"{_H100_HOST}: fitted on the reference transformer (1.27 and 1.83)",
    "link_latency_s": "order of magnitude of NCCL point-to-point small-message latency "
                      "over NVLink (nccl-tests sendrecv_perf); not a datasheet figure",
    "message_overhead_s": "estimate: host time to enqueue one NCCL send or receive",
    "microbatch_overhead_s": "order of magnitude of the smp-fx runtime per action from "
                             "smp-fx calibrate on the 2-core development CPU (host Python; "
                             "a GPU host's CPU is faster)",
    "step_overhead_s": "order of magnitude of the smp-fx runtime per step from smp-fx "
                       "calibrate on the 2-core development CPU",
    "optimizer_tensor_s": f"{_H100_HOST}: torch.optim.Adam's default (foreach) step, "
                          "11.5 and 12.8 us per tensor",
    "optimizer_byte_s": "Adam streams 7 bytes per parameter byte (read param, grad, two "
                        "moments; write param, two moments) at mem_bandwidth",
    "sm_count": f"{NO_WAVES}; the rounded estimates the golden plans are made with (the "
                "sourced GPUs of cost_model.gpu_specs have one)",
}


def _gpu(name: str, fp32: float, bf16: float, bandwidth: float, memory: int,
         link: float) -> DeviceSpec:
    sheet = _DATASHEET[name]
    sheet_fields = ("peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "memory_bytes")
    sources = {**_GPU_SOURCES, **{k: sheet for k in sheet_fields},
               "link_bandwidth": f"{sheet}: NVLink total bandwidth / 2 (one direction)"}
    return DeviceSpec(name, fp32, bf16, bandwidth, memory, link, 5e-6,
                      matmul_efficiency=_GPU_MATMUL, elementwise_efficiency=_GPU_ELEMENTWISE,
                      op_overheads=_GPU_OPS, message_overhead_s=10e-6,
                      microbatch_overhead_s=100e-6, step_overhead_s=100e-6,
                      optimizer_tensor_s=12e-6, optimizer_byte_s=7.0 / bandwidth,
                      overhead_scale=_GPU_OVERHEAD_SCALE,
                      sources=tuple(sorted(sources.items())))


H100 = _gpu("h100", 67e12, 989.4e12, 3.35e12, 80 * GiB, 450 * GB)
A100 = _gpu("a100", 19.5e12, 312e12, 2.039e12, 80 * GiB, 300 * GB)
V100 = _gpu("v100", 15.7e12, 125e12, 0.9e12, 32 * GiB, 150 * GB)

__all__ = ["A100", "H100", "V100"]
