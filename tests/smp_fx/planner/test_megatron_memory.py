"""What Megatron-Core keeps, as the planner prices runs made with it: its distributed
optimizer sharded over dp x cp (smp-fx's ZeRO-1 over dp only); a Llama layer's activations
as its fused kernels keep them, against a closed form in the manner of Korthikanti et al.
2022 (section 4), per layer and tensor-parallel rank, 2-byte activations (s sequence, b
microbatch, h hidden, f FFN width, a heads, g key-value heads, t tensor-parallel degree):

- attention: the RMSNorm's input 2sbh, the QKV GEMMs' input 2sbh (one tensor for the
  three), flash attention's q 2sbh/t, k and v 4sbh g/(at) (grouped heads, not repeated)
  and output 2sbh/t (the projection's input too), its log-sum-exp 4asb/t (float32);
- MLP: the RMSNorm's input 2sbh, the gate and up GEMMs' input 2sbh, SwiGLU's gate and up
  4sbf/t and the down projection's input 2sbf/t;
- with sequence parallelism the norms' and GEMMs' inputs are the 1/t chunk (gathered again
  in backward): ``sbh/t (12 + 4g/a + 6f/h) + 4asb/t``; without it
  ``sbh (8 + (4 + 4g/a + 6f/h)/t) + 4asb/t``.

The rotary tables (the head's values) are shared by every layer and not counted per layer;
the norms' float32 reciprocal deviations (4sb each, /t under sp) are left out of both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cost_model.cluster import get_cluster
from cost_model.errors import SMPConfigError
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.layers import KEPT
from smp_fx.planner.model import Profiler
from smp_fx.planner.stages import rank_loads
from smp_fx.planner.step import Setting, memory_by_rank, price

ROOT = Path(__file__).resolve().parents[3]
LLAMA = ROOT / "tests" / "data" / "hf_tiny_llama"
SEQ, MBS = 32, 1
CLUSTER = get_cluster("dgx-h100")


@pytest.fixture(scope="module")
def llama() -> Profiler:
    pytest.importorskip("transformers")
    from smp_fx.planner.hf_config import prepare_config

    return Profiler(prepare_config(LLAMA, SEQ), CLUSTER)


@pytest.mark.parametrize("runtime, divided", [("megatron-core", 2), ("smp-fx", 1)])
def test_distributed_optimizer_shards_over_cp_under_megatron_only(
        llama: Profiler, runtime: str, divided: int) -> None:
    prof = llama(MBS, 1, False)
    ranks = rank_loads(prof, "none", 1, 1, "interleaved", CLUSTER.device)
    assert ranks is not None
    opt = {}
    for cp in (1, 2):
        c = Candidate(1, 1, 2, MBS, 1, "interleaved", "none", False, "zero1", cp=cp)
        setting = Setting(CLUSTER, 2 * cp, 2 * MBS, runtime=runtime)
        opt[cp] = memory_by_rank(c, ranks, prof, setting)[0].optimizer
    assert opt[2] == -(-opt[1] // divided)


S, H, F, A, G = 64, 64, 224, 16, 4
"""A Llama shape with Llama-3-70B's ratios of FFN width (3.5 h) and one key-value head per
four query heads."""


def closed_form(tp: int, sp: bool, b: int = 1) -> float:
    """The module docstring's bytes per layer and rank."""
    sbh, lse = S * b * H, 4 * A * S * b / tp
    own = 4 + 4 * G / A + 6 * F / H
    return sbh * (8 + own) / tp + lse if sp else sbh * (8 + own / tp) + lse


@pytest.fixture(scope="module")
def llama_shaped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Profiler]:
    pytest.importorskip("transformers")
    from smp_fx.planner.hf_config import prepare_config

    doc = json.loads((LLAMA / "config.json").read_text())
    doc.update(hidden_size=H, intermediate_size=F, num_attention_heads=A,
               num_key_value_heads=G, max_position_embeddings=S)
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(doc))
    prep = prepare_config(path, S)
    return {rt: Profiler(prep, CLUSTER, runtime=rt) for rt in ("megatron-core", "smp-fx")}


@pytest.mark.parametrize("tp, sp", [(1, False), (4, True), (4, False)])
def test_a_llama_layer_keeps_the_closed_form_under_megatron(
        llama_shaped: dict[str, Profiler], tp: int, sp: bool) -> None:
    layer = llama_shaped["megatron-core"](1, tp, sp).parts[KEPT]
    assert layer.kept("none")[0] == pytest.approx(closed_form(tp, sp), rel=0.01)
    assert layer.kept("selective")[0] == layer.kept("none")[0]  # flash keeps no scores
    full = layer.kept("full")
    assert full[1] == layer.kept("none")[0]  # the layer's values again while recomputed
    eager = llama_shaped["smp-fx"](1, tp, sp).parts[KEPT].kept("none")[0]
    assert eager > 1.5 * closed_form(tp, sp)  # float32 norms, repeated k and v, silu's output


def test_bf16_gradients_hold_and_reduce_half_of_fp32_main_gradients(llama: Profiler) -> None:
    """NeMo's ``grad_sync_dtype: bf16``: a bf16 gradient buffer (2 bytes a parameter, not
    Megatron-Core's fp32 4), reduce-scattered in bf16; the rest of the state unchanged."""
    prof = llama(MBS, 1, False)
    ranks = rank_loads(prof, "none", 1, 1, "interleaved", CLUSTER.device)
    assert ranks is not None
    c = Candidate(1, 1, 8, MBS, 1, "interleaved", "none", False, "zero1")
    fp32, bf16 = (Setting(CLUSTER, 8, 8 * MBS, runtime="megatron-core", megatron_grads=g)
                  for g in ("fp32", "bf16"))
    m32, m16 = (memory_by_rank(c, ranks, prof, s)[0] for s in (fp32, bf16))
    assert m32.grads - m16.grads == 2 * ranks.elems[0]
    assert (m32.params, m32.optimizer, m32.activations) == (
        m16.params, m16.optimizer, m16.activations)
    d32, d16 = (price(c, ranks, prof, s).comm.dp for s in (fp32, bf16))
    assert d16 < d32
    with pytest.raises(SMPConfigError, match="megatron_grads"):
        memory_by_rank(c, ranks, prof, dataclasses.replace(bf16, megatron_grads="fp8"))


def test_megatron_holds_logits_on_the_last_stage_split_and_sends_no_outputs(
        llama: Profiler) -> None:
    prof = llama(MBS, 2, True)
    ranks = rank_loads(prof, "none", 2, 1, "interleaved", CLUSTER.device)
    assert ranks is not None and prof.output_bytes > 0
    c = Candidate(2, 2, 1, MBS, 1, "interleaved", "none", True, "zero1", cp=2)
    mega, smp = (memory_by_rank(c, ranks, prof, Setting(CLUSTER, 8, 2 * MBS, runtime=rt))
                 for rt in ("megatron-core", "smp-fx"))
    assert [m.outputs for m in mega] == [0, 2 * prof.output_bytes // 4]
    assert all(m.outputs == 2 * prof.output_bytes for m in smp)
    act = max(a for a, _ in ranks.hops)
    assert mega[0].buffers == 4 * act + ranks.buffers[0]
    assert mega[0].activations == round(ranks.kept[0] * 2 / 2)  # no gathered k and v


class _Norm(torch.nn.Module):
    """An RMSNorm op by op (as Hugging Face writes it) between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(H))
        self.inp = torch.nn.Linear(H, H, bias=False)
        self.fc = torch.nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.fc(self.w * y.to(x.dtype))


def test_an_elementwise_group_fused_moves_its_input_and_output_once() -> None:
    from cost_model.device import DeviceSpec
    from passes import meta
    from passes.annotate_costs import annotate_costs
    from passes.shape_prop import shape_prop
    from passes.trace import trace
    from smp_fx.planner.fused import elementwise_saving

    spec = DeviceSpec("ideal", 1e15, 1e15, 1e12, 2**30, 1e11, 0.0)
    x = torch.randn(S, H, dtype=torch.bfloat16, requires_grad=True)
    model = _Norm().bfloat16()
    gm = annotate_costs(shape_prop(trace(model, (x,)), (x,)), spec)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    group = [n for n in nodes if n.op in ("call_function", "call_method")
             and meta.COST.get(n).op != "linear"]
    assert len(group) >= 6
    op_by_op = [sum(meta.COST.get(n).fwd_time_s for n in group),
                sum(meta.COST.get(n).bwd_time_s for n in group)]
    saved = elementwise_saving(nodes, spec)
    once = 2 * x.numel() * 2 / spec.mem_bandwidth  # read the input, write the bf16 output
    assert op_by_op[0] - saved[0] == pytest.approx(once)
    assert op_by_op[1] - saved[1] == pytest.approx(2 * once)
    assert op_by_op[0] > 3 * once  # float32 copies, a square, a mean, two products


def test_gpt_oss_built_eager_and_its_attention_kept_as_flash_under_megatron(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """transformers has no sdpa for GPT-OSS (its sinks): built eager, logged; under
    Megatron-Core a layer's bytes grow with the sequence, not its square (no scores)."""
    pytest.importorskip("transformers")
    from smp_fx.planner.hf_config import prepare_config

    doc = json.loads((ROOT / "examples" / "configs" / "gpt-oss-120b.json").read_text())
    doc.update(hidden_size=32, intermediate_size=32, head_dim=8, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               num_hidden_layers=4, layer_types=["full_attention"] * 4, vocab_size=128,
               sliding_window=8, pad_token_id=0, eos_token_id=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    kept = {}
    with caplog.at_level("WARNING", logger="smp_fx.planner.hf_config"):
        for seq in (32, 64):
            prep = prepare_config(path, seq)
            for rt in ("megatron-core", "smp-fx"):
                layer = Profiler(prep, CLUSTER, runtime=rt)(1, 1, False).parts[KEPT]
                kept[rt, seq] = layer.kept("none")[0]
    assert "built with eager attention" in caplog.text
    assert kept["megatron-core", 64] == pytest.approx(2 * kept["megatron-core", 32], rel=0.01)
    assert kept["smp-fx", 64] > 2.2 * kept["smp-fx", 32]  # eager keeps s x s scores


def test_megatron_runs_price_attention_as_transformer_engine_runs_it(
        llama_shaped: dict[str, Profiler]) -> None:
    """Megatron-Core's runs take cuDNN's published attention by sequence length; smp-fx's
    keep the sdpa rate its calibration measured."""
    mc, own = llama_shaped["megatron-core"], llama_shaped["smp-fx"]
    assert mc.device.attention_rates and not own.device.attention_rates
    assert mc.device.attention_rate(S) != own.device.attention_rate(S)
    assert own.device is CLUSTER.device


class _Attention(torch.nn.Module):
    """Causal attention over (batch, heads, seq, head dimension): fused (sdpa) or written op
    by op (scores, softmax, context), as transformers builds a model without sdpa."""

    def __init__(self, eager: bool) -> None:
        super().__init__()
        self.eager = eager

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.eager:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return torch.matmul(torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("eager", [False, True])
def test_attention_is_priced_at_its_head_dimensions_rate(eager: bool) -> None:
    """The same FLOPs at head dimension 64 take longer than at 128 on a GPU whose published
    rates say so: the fused op (``annotate_costs``) and an eager core priced as one flash
    kernel under Megatron-Core (``elementwise_saving``) alike."""
    from cost_model.gpu_specs import SOURCED_GPUS, with_te_attention
    from passes import meta
    from passes.annotate_costs import annotate_costs
    from passes.shape_prop import shape_prop
    from passes.trace import trace
    from smp_fx.planner.fused import elementwise_saving

    spec = with_te_attention(SOURCED_GPUS["h100-sxm"])
    rate = {}
    for heads, dim in ((8, 64), (4, 128)):  # the same width: the same FLOPs
        qkv = [torch.randn(1, heads, 4096, dim, dtype=torch.bfloat16, requires_grad=True,
                           device="meta") for _ in range(3)]
        gm = annotate_costs(shape_prop(trace(_Attention(eager), tuple(qkv)), tuple(qkv)), spec)
        nodes = [n for n in gm.graph.nodes if n.op != "output"]
        costs = [meta.COST.get(n) for n in nodes if meta.COST.has(n)]
        flops = sum(c.fwd_flops for c in costs if c.op in ("sdpa", "matmul"))
        fwd = sum(c.fwd_time_s for c in costs) - (elementwise_saving(nodes, spec)[0]
                                                   if eager else 0.0)
        rate[dim] = flops / fwd
    assert rate[128] == pytest.approx(2 * 518e12, rel=0.02)  # cuDNN's causal rate at 4K
    assert rate[64] == pytest.approx(2 * 363e12, rel=0.02)
