"""``cost_model.model_sizes``: a spec measured again at a model's sizes, on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_model import model_sizes
from cost_model.calibrate import LOOPBACK
from cost_model.errors import SMPConfigError
from cost_model.microbench import QUICK
from cost_model.model_sizes import TINY, ModelSizes, at_model_sizes
from smp_fx.cli.calibrate import _sizes, build_parser

BASE = dataclasses.replace(LOOPBACK, op_overheads=(("default", 1e-6, 2e-6),),
                           op_rates=(("sdpa", 1.0, 1.0, 4.0), ("gelu", 1.0, 1.0, 8.0)))


@pytest.mark.parametrize("overlaps", [False, True])
def test_at_model_sizes_measures_each_figure(monkeypatch: pytest.MonkeyPatch,
                                             overlaps: bool) -> None:
    monkeypatch.setattr(model_sizes, "host_overlaps", lambda device: overlaps)
    spec = at_model_sizes(BASE, torch.device("cpu"), TINY, QUICK)
    assert [d for d, _ in spec.matmul_efficiency] == [4.0, 16.0, 32.0]
    assert max(f for _, f in spec.matmul_efficiency) == 1.0
    assert spec.peak_flops_fp32 != BASE.peak_flops_fp32  # float32 sizes: the fp32 peak
    assert spec.peak_flops_bf16 == BASE.peak_flops_bf16
    assert [b for b, _ in spec.elementwise_efficiency] == [3.0 * 2**10, 3.0 * 2**16]
    fwd, bwd, ref = spec.op_rate("sdpa") or (0.0, 0.0, 0.0)
    assert 0 < fwd < 1 and 0 < bwd < 1 and ref == min(TINY.seq, TINY.head_dim)
    assert spec.optimizer_tensor_s + spec.optimizer_byte_s > 0
    if overlaps:  # the host queues ops under the kernels: no fixed costs, rates by roofline
        assert spec.op_overheads == () and [k for k, *_ in spec.op_rates] == ["sdpa"]
        assert "1.0 us per op forward" in spec.source("op_overheads")
    else:
        assert spec.op_overheads == BASE.op_overheads
        assert spec.op_rate("gelu") == (1.0, 1.0, 8.0)
    assert "cost_model.model_sizes" in spec.source("matmul_efficiency")


def test_sizes_from_the_calibrate_flags() -> None:
    parse = build_parser().parse_args
    assert _sizes(parse(["--device", "cpu"])) is None
    cpu = _sizes(parse(["--device", "cpu", "--attention", "8x256x64"]))
    assert cpu is not None and (cpu.heads, cpu.seq, cpu.head_dim) == (8, 256, 64)
    assert cpu.dtype == "float32" and max(cpu.matmul_dims) == 512
    gpu = _sizes(parse(["--device", "cuda", "--matmul-max", "4096"]))
    assert gpu == ModelSizes(matmul_dims=(16, 64, 128, 256, 512, 1024, 2048, 4096))
    with pytest.raises(SMPConfigError, match="HEADSxSEQxHEAD_DIM"):
        ModelSizes.parse("16x1024")
