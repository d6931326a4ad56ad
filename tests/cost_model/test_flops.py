from __future__ import annotations

from cost_model.flops import (
    conv_flops,
    gemm_dims,
    linear_flops,
    matmul_flops,
    op_flops,
    sdpa_flops,
)
from cost_model.saved import SavedRule, saved_rule


def test_contractions() -> None:
    assert linear_flops((8, 32), (8, 64)) == 2 * 8 * 32 * 64
    assert op_flops("linear", [(2, 5, 32)], (2, 5, 64), {}) == (2 * 10 * 32 * 64,
                                                                 2 * 2 * 10 * 32 * 64)
    assert matmul_flops((3, 4, 5), (3, 5, 6), (3, 4, 6)) == 2 * 3 * 4 * 6 * 5
    assert op_flops("addmm", [(6,), (4, 5), (5, 6)], (4, 6), {})[0] == 2 * 4 * 5 * 6
    assert op_flops("bmm", [(3, 4, 5), (3, 5, 6)], (3, 4, 6), {})[0] == 2 * 3 * 4 * 6 * 5
    # a mixture of experts' grouped GEMM: 12 routed rows over 4 experts of (5 -> 6)
    moe = [(12, 5), (4, 5, 6), (4,)]
    assert op_flops("grouped_mm", moe, (12, 6), {}) == (2 * 12 * 5 * 6, 2 * 2 * 12 * 5 * 6)
    assert gemm_dims("grouped_mm", moe, (12, 6), {}) == (3, 5, 6)  # rows per expert
    assert saved_rule("grouped_mm", moe, (12, 6), {}, [True, True, False],
                      False) == SavedRule(inputs=(0, 1))


def test_conv_and_attention() -> None:
    # Conv2d(3 -> 8, 3x3) on 16x16 with padding: 2 * out elements * Cin * k*k
    assert conv_flops((8, 3, 3, 3), (2, 8, 16, 16)) == 2 * 2 * 8 * 16 * 16 * 27
    assert op_flops("conv", [(2, 4, 8, 8)], (2, 8, 8, 8),
                    {"weight": (8, 2, 3, 3), "groups": 2})[0] == 2 * 2 * 8 * 8 * 8 * 18
    q = (2, 4, 16, 8)
    assert sdpa_flops(q, q, q) == 2 * 2 * 2 * 4 * 16 * 16 * 8
    assert op_flops("sdpa", [q, q, q], q, {}) == (sdpa_flops(q, q, q), 2 * sdpa_flops(q, q, q))


def test_cheap_ops_and_unknown() -> None:
    assert op_flops("view", [(4, 4)], (16,), {}) == (0.0, 0.0)
    assert op_flops("relu", [(4, 4)], (4, 4), {}) == (16.0, 16.0)
    assert op_flops("layer_norm", [(4, 8)], (4, 8), {})[0] == 5 * 32
    assert op_flops("embedding", [(2, 3)], (2, 3, 8), {}) == (0.0, 48.0)
    assert op_flops("sum", [(4, 8)], (), {}) == (32.0, 32.0)
    assert op_flops("fft_rfft", [(8,)], (5,), {}) is None


def test_saved_rules() -> None:
    assert saved_rule("relu", [(4,)], (4,), {}, [True], False) == SavedRule(output=True)
    assert saved_rule("gelu", [(4,)], (4,), {}, [True], False) == SavedRule(inputs=(0,))
    assert saved_rule("linear", [(4, 8)], (4, 2), {}, [False], True) == SavedRule(inputs=(0,))
    assert saved_rule("matmul", [(2, 3), (3, 4)], (2, 4), {}, [True, False],
                      False) == SavedRule(inputs=(1,))
    assert saved_rule("mul", [(4,), None], (4,), {}, [True], False) == SavedRule()
    assert saved_rule("layer_norm", [(8, 64)], (8, 64), {}, [True], True) == SavedRule(
        inputs=(0,), extra_bytes=8 * 2 * 4)
    assert saved_rule("dropout", [(10,)], (10,), {"p": 0.1}, [True], False) == SavedRule(
        extra_bytes=10)
    assert saved_rule("relu", [(4,)], (4,), {}, [False], False) == SavedRule()  # no grad
    assert saved_rule("fft_rfft", [(8,)], (5,), {}, [True], False) is None
