"""The GPUs the built-in clusters run, from public figures: datasheets, GEMM and attention
benchmarks, nccl-tests; each number names its source in ``sources``.

The plain ``a100``/``h100``/``v100`` device specs (``cost_model.datasheets``) stay the rounded
estimates the golden plans were made with; a cluster carries the sourced GPU. Nothing here
is fitted on the training runs ``benchmarks/plan_validation.py`` judges; the A100's two
matmul efficiencies are fitted on Megatron-LM SC'21 Table 1 (``MEGATRON_FIT``, declared).
"""

from __future__ import annotations

import dataclasses

from cost_model.datasheets import A100, H100
from cost_model.device import GB, AttentionRates, DeviceSpec, GiB, OpRates, Table

MEGATRON_FIT: Table = ((16.0, 0.03), (96.0, 0.1141), (160.0, 0.1141), (512.0, 0.8333),
                       (4096.0, 0.8333))
"""The A100's matmul efficiency by smallest dimension: two figures fitted on Megatron-LM
SC'21 Table 1 alone (``benchmarks/megatron_table.py --fit``): head-dimension matmuls
(96-160: attention with the unfused softmax, mask and dropout of those runs) and large
matmuls (512 and up); the 16 entry is the device's estimate. Fitted with each GEMM's wave
quantization priced (``cost_model.waves``), so they are the rates of whole waves."""
_FIT_SOURCE = ("fitted on Megatron-LM SC'21 (arXiv 2104.04473) Table 1 only, by "
               "benchmarks/megatron_table.py --fit (least squares of log predicted / "
               "published TFLOP/s over its 10 runs); the 16 entry is the a100 spec's "
               "estimate")

_GH100_CAL = ("smp-fx's own GEMM microbenchmark (benchmarks/plan_gpu.py's calibration, CUDA "
              "events, torch 2.11 + CUDA 13.0) on an H200 SXM, the H100's GH100 compute die "
              "at the same 700 W, 2026-11-28 (docs/planning.md, 'On a GPU')")
HOPPER_MATMUL: Table = ((16.0, 0.058), (128.0, 0.41), (512.0, 0.69), (8192.0, 0.72))
"""bf16 cuBLAS matmuls on GH100 by smallest dimension, as a fraction of the 989 TFLOP/s
dense peak: 713 TFLOP/s at large sizes (0.72), 96 % of that from 512, 57 % at 128, 8 % at
16 (``_GH100_CAL``)."""
_FP8_CURVE = ("estimate: no published FP8 GEMM curve by size was read, so FP8 GEMMs are "
              "priced at the bf16 table's fraction of the FP8 peak (twice the bf16 rate)")

HOPPER_SDPA: OpRates = (("sdpa", 1 / 544e12, 1 / 252e12, 128.0),)
"""Causal fused attention (PyTorch sdpa, FlashAttention backend) at head dimension 128,
sequence 1024: 544 TFLOP/s forward, 252 backward, FLOPs counted full-square as
``cost_model.flops.sdpa_flops`` counts them (``_GH100_CAL``). FlashAttention-3's paper
(arXiv 2407.08608) reports up to 740 TFLOP/s forward (fp16, 75 % of peak) on H100:
longer sequences run faster than this rate says."""
_FA3_FIGURES = ("FlashAttention-3, Shah et al., arXiv 2407.08608, Figure 5 (forward, causal "
                "mask, head dimensions 64 and 128) and Figure 6 (backward, head dimensions 64 "
                "and 128) on H100 80GB SXM5, the cuDNN bars at sequence 512-16k")
_FA3_LENGTHS = (512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
"""The key lengths of ``_FA3_FIGURES``' bars."""
Bars = dict[int, tuple[tuple[int, ...], tuple[int, ...]]]
"""head dimension -> (causal forward, backward) TFLOP/s as a figure prints them, one a
length of ``_FA3_LENGTHS``."""


def full_square(bars: Bars) -> AttentionRates:
    """``DeviceSpec.attention_rates`` rows from ``_FA3_FIGURES``' bars, on full-square FLOPs
    (``cost_model.flops``): the forward, causal and counted on half the square, times 2;
    the backward, counted as 2.5 forwards and published without mask (a causal backward
    is taken at the same rate per FLOP done), times 2 x 2 / 2.5."""
    return tuple((length, 2 * f * 1e12, 4 * b * 1e12 / 2.5, float(dim))
                 for dim, (fwd, bwd) in sorted(bars.items())
                 for length, f, b in zip(_FA3_LENGTHS, fwd, bwd, strict=True))


HOPPER_TE_ATTENTION: AttentionRates = full_square({
    64: ((225, 288, 334, 363, 379, 388), (266, 348, 395, 417, 432, 433)),
    128: ((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516))})
"""Causal attention as Transformer Engine runs it on Hopper (cuDNN fused attention: NeMo's
recipes set ``NVTE_FUSED_ATTN=1``, ``NVTE_FLASH_ATTN=0``, dgxc-benchmarking
llama3.1/configure.sh), by head dimension and key length: the cuDNN bars of
``_FA3_FIGURES`` (``full_square``)."""
TE_ATTENTION: dict[str, AttentionRates] = {"h100": HOPPER_TE_ATTENTION,
                                           "h200": HOPPER_TE_ATTENTION}
"""The GPUs with published fused-attention rates by sequence length (the H200: the H100's
compute die)."""


HOPPER_FLASH2_ATTENTION: AttentionRates = full_square({
    64: ((180, 229, 262, 284, 295, 299), (198, 238, 264, 279, 287, 291)),
    128: ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322))})
"""Causal attention as Transformer Engine runs it on Hopper with ``NVTE_FUSED_ATTN=0``: its
FlashAttention backend (flash-attn 2), by head dimension and key length: the
FlashAttention-2 bars of the figures ``HOPPER_TE_ATTENTION`` reads (``full_square``)."""
ATTENTION_BACKENDS: dict[str, dict[str, AttentionRates]] = {
    "cudnn": TE_ATTENTION,
    "flash2": {"h100": HOPPER_FLASH2_ATTENTION, "h200": HOPPER_FLASH2_ATTENTION}}
"""Transformer Engine's attention backends with published Hopper rates: ``cudnn`` (its
FusedAttention, preferred on Hopper by TE's ``get_attention_backend``) and ``flash2``."""


def with_attention(spec: DeviceSpec, backend: str) -> DeviceSpec:
    """``spec`` with the published rates of one of Transformer Engine's attention backends
    (``ATTENTION_BACKENDS``), for a run whose recipe picks it; an error for a backend or
    GPU without published rates."""
    rates = ATTENTION_BACKENDS.get(backend, {}).get(spec.name)
    if rates is None:
        raise ValueError(f"attention backend {backend!r} on {spec.name!r}: no published "
                         f"rates (known: {sorted(ATTENTION_BACKENDS)} on h100, h200); "
                         "leave the backend blank for the GPU's default")
    where = _FA3_FIGURES + (": cuDNN fused attention" if backend == "cudnn"
                            else ": the FlashAttention-2 bars")
    return dataclasses.replace(spec, attention_rates=rates).with_sources(
        attention_rates=where)


def with_te_attention(spec: DeviceSpec) -> DeviceSpec:
    """``spec`` with Transformer Engine's attention by sequence length where it is published
    (``TE_ATTENTION``), to price runs made with Megatron-Core; smp-fx's own runs keep the
    sdpa rate its calibration measured (PyTorch's flash backend)."""
    rates = TE_ATTENTION.get(spec.name)
    if rates is None or spec.attention_rates:
        return spec
    return dataclasses.replace(spec, attention_rates=rates).with_sources(
        attention_rates=f"{_FA3_FIGURES}: cuDNN fused attention "
                        "(what Transformer Engine runs in NeMo's recipes)")


BLACKWELL_MATMUL: Table = ((16.0, 0.037), (128.0, 0.26), (512.0, 0.44), (2048.0, 0.447),
                           (4096.0, 0.681), (8192.0, 0.716))
"""bf16 cuBLAS on B200 (PyTorch 2.8, CUDA 12.8) as a fraction of the 2250 TFLOP/s dense
peak: 1006 TFLOP/s at 2048^3, 1532 at 4096^3, 1610 at 8192^3 (pyptx.dev/performance,
'Blackwell GEMM' table, cuBLAS column); below 2048 no published figure was found: the
entries are GH100's curve scaled to meet the B200's 0.447 at 2048 (estimate)."""

_WAVES_GUIDE = ("NVIDIA's 'Matrix Multiplication Background User's Guide' (DU-09799-001, "
                "docs.nvidia.com/deeplearning/performance), 'Wave Quantization'")
_GH100_SMS = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs on H100 SXM5 "
              "(of the full GH100's 144)")
_HOPPER_TILE = ("estimate: 128 x 256 output tiles, the tile of cuBLAS's large bf16 Hopper "
                "kernels (named sm90_xmma_gemm_..._tilesize128x256x64_warpgroupsize2x1x1 in "
                "Nsight traces) and of CUTLASS 3's cooperative warp-specialized kernel; "
                "cuBLAS's heuristics pick among several per shape, which is not published")
HOPPER_SHAPES = "linear:8192"
"""``HOPPER_MATMUL``'s shapes: smp-fx's microbenchmark (``matmul_table``) against 8192."""
_GPU_ELEMENTWISE: Table = ((1e5, 0.1), (1e7, 0.6), (1e8, 0.85))
_HOST_HIDDEN = ("zero: on a GPU the host enqueues kernels ahead of the device, so eager "
                "PyTorch's per-op host time hides behind kernels of these sizes; "
                "benchmarks/plan_gpu.py prices its H200 step within 2 % with it zero")
_ELEMENTWISE = ("estimate: small kernels are launch-bound, large streaming kernels reach "
                "about 85-90 % of HBM peak (the H200 calibration measured 4.3 of 4.8 TB/s)")


def _sourced(spec: DeviceSpec, notes: dict[str, str]) -> DeviceSpec:
    return spec.with_sources(op_overheads=_HOST_HIDDEN, elementwise_efficiency=_ELEMENTWISE,
                             **notes)


def _hopper(name: str, bandwidth: float, memory: int, sheet: str, sms: str) -> DeviceSpec:
    spec = dataclasses.replace(
        H100, name=name, mem_bandwidth=bandwidth, memory_bytes=memory,
        matmul_efficiency=HOPPER_MATMUL, elementwise_efficiency=_GPU_ELEMENTWISE,
        op_rates=HOPPER_SDPA, op_overheads=(), optimizer_byte_s=7.0 / bandwidth,
        sm_count=132, gemm_tile=(128, 256), matmul_shapes=HOPPER_SHAPES,
        peak_flops_fp8=1979e12)
    return _sourced(spec, {
        "sm_count": f"{sms}; waves as {_WAVES_GUIDE} documents them",
        "gemm_tile": _HOPPER_TILE,
        "matmul_shapes": f"how {_GH100_CAL} measured HOPPER_MATMUL: each size in a linear's "
                         "three places against 8192 (cost_model.microbench.matmul_table)",
        "peak_flops_bf16": f"{sheet}: 1,979 TFLOPS BF16 with sparsity, 989.4 dense",
        "peak_flops_fp8": f"{sheet}: 3,958 TFLOPS FP8 with sparsity, 1,979 dense",
        "peak_flops_fp32": f"{sheet}: 67 TFLOPS FP32",
        "mem_bandwidth": sheet, "memory_bytes": sheet,
        "link_bandwidth": f"{sheet}: NVLink 900 GB/s, half each way",
        "matmul_efficiency": f"{HOPPER_MATMUL} from {_GH100_CAL}; FP8 GEMMs at the same "
                             f"fraction of the FP8 peak: {_FP8_CURVE}",
        "op_rates": f"causal sdpa 544 / 252 TFLOP/s (full-square FLOPs) from {_GH100_CAL}"})


H100_SXM = _hopper("h100", 3.35e12, 80 * GiB,
                   "NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB)", _GH100_SMS)
H200_SXM = _hopper("h200", 4.8e12, int(141 * GB), "NVIDIA H200 Tensor Core GPU datasheet "
                   "(SXM, 141 GB HBM3e, 4.8 TB/s; the H100's compute)",
                   f"{_GH100_SMS}; the H200 datasheet gives no SM count: the H100 SXM5's "
                   "GH100 configuration, as its equal compute figures say (estimate)")

_B200_SHEET = ("glennklockwood.com/garden/processors/B200 (HGX B200 at 1000 W: BF16 2250 "
               "TFLOPS dense, FP32 80)")
B200 = _sourced(dataclasses.replace(
    H100, name="b200", peak_flops_fp32=80e12, peak_flops_bf16=2250e12, peak_flops_fp8=4500e12,
    mem_bandwidth=8e12,
    memory_bytes=int(179 * GB), link_bandwidth=900 * GB, matmul_efficiency=BLACKWELL_MATMUL,
    elementwise_efficiency=_GPU_ELEMENTWISE, op_overheads=(),
    op_rates=(("sdpa", 989.4 / 2250 / 544e12, 989.4 / 2250 / 252e12, 128.0),),
    optimizer_byte_s=7.0 / 8e12, sm_count=148, gemm_tile=(128, 256), matmul_shapes="cube"), {
    "sm_count": "Chips and Cheese, 'Nvidia's B200: Keeping the CUDA Juggernaut Rolling' "
                "(2025): 74 SMs enabled on each of its two dies, 148 in all (NVIDIA's B200 "
                f"datasheet gives no SM count); waves as {_WAVES_GUIDE} documents them",
    "gemm_tile": "estimate: 128 x 256 per SM, half of the 256 x 256 tile that Blackwell's "
                 "two-SM tensor-core instructions compute per SM pair in CUTLASS's and "
                 "cuBLAS's large bf16 kernels; not published per shape",
    "matmul_shapes": "cubes: pyptx.dev's cuBLAS column times d x d x d GEMMs",
    "peak_flops_bf16": _B200_SHEET, "peak_flops_fp32": _B200_SHEET,
    "peak_flops_fp8": "estimate: twice the dense BF16 peak, as on Hopper (the Blackwell "
                      "tensor core's FP8 rate; not read from a B200 datasheet)",
    "mem_bandwidth": "docs.vultr.com HGX B200 hardware overview: 8.0 TB/s HBM3e",
    "memory_bytes": "docs.vultr.com HGX B200 hardware overview: 179 GB as nvidia-smi "
                    "reports it",
    "link_bandwidth": "docs.vultr.com HGX B200 hardware overview: NVLink 5 1.8 TB/s "
                      "bidirectional, half each way",
    "matmul_efficiency": f"{BLACKWELL_MATMUL} from pyptx.dev/performance's cuBLAS column "
                         "(bf16 on B200, 2048-8192 cubed); below 2048 GH100's curve "
                         f"scaled (estimate); FP8 GEMMs at the same fraction: {_FP8_CURVE}",
    "op_rates": "estimate: GH100's measured causal sdpa rates (544 / 252 TFLOP/s) times "
                "the peak ratio 2250 / 989; no published B200 attention figure was read"})

_GA100_WAVES = {
    "sm_count": "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs on A100 (of "
                f"the full GA100's 128); {_WAVES_GUIDE} works its example on these 108",
    "gemm_tile": f"{_WAVES_GUIDE}: 256 x 128 thread-block tiles, one per SM on A100, in "
                 "its wave-quantization example ('Typical Tile Dimensions In cuBLAS And "
                 "Performance': the larger tiles are the most efficient)",
    "matmul_shapes": "none: MEGATRON_FIT is fitted with the waves priced, so it carries no "
                     "quantization of its own"}
A100_80GB = dataclasses.replace(A100, matmul_efficiency=MEGATRON_FIT, sm_count=108,
                                gemm_tile=(256, 128)).with_sources(
    matmul_efficiency=_FIT_SOURCE, **_GA100_WAVES)
A100_40GB = dataclasses.replace(A100, name="a100-40gb", mem_bandwidth=1.555e12,
                                memory_bytes=40 * GiB, optimizer_byte_s=7.0 / 1.555e12,
                                matmul_efficiency=MEGATRON_FIT, sm_count=108,
                                gemm_tile=(256, 128)).with_sources(
    mem_bandwidth="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)",
    memory_bytes="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)",
    matmul_efficiency=_FIT_SOURCE + " (the same silicon as the 80GB part)", **_GA100_WAVES)

SOURCED_GPUS: dict[str, DeviceSpec] = {
    "a100-40gb": A100_40GB, "a100-80gb": A100_80GB, "h100-sxm": H100_SXM,
    "h200-sxm": H200_SXM, "b200": B200}
"""The GPUs of the built-in clusters; every numeric field names where it comes from."""
FITTED_ON = {"a100-80gb": ("matmul_efficiency", _FIT_SOURCE),
             "a100-40gb": ("matmul_efficiency", _FIT_SOURCE)}
"""Which figure of which GPU is fitted, and on what (the rest are read, not fitted)."""
