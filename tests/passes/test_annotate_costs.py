from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from cost_model.devices import H100
from cost_model.measure import saved_bytes_by_module
from cost_model.node_cost import NodeCost
from passes import annotate_costs as annotate_costs_module
from passes.annotate_costs import annotate_costs
from passes.meta import COST
from passes.shape_prop import shape_prop
from passes.trace import trace
from smp_fx.marking.delayed_init import delay_param_initialization
from tests.helpers.models import (
    EXPECTED_FRONTEND,
    DataDependent,
    build,
    example,
    state_bytes,
)


def _costed(name: str, batch: int = 2) -> tuple[nn.Module, tuple, torch.fx.GraphModule]:
    model, args = build(name, batch)
    gm = shape_prop(trace(model, args), args)
    return model, args, annotate_costs(gm, H100)


@pytest.mark.parametrize("name", sorted(EXPECTED_FRONTEND))
def test_param_bytes_exact_and_saved_bytes_match_autograd(name: str) -> None:
    model, args, gm = _costed(name)
    costs = [COST.get(n) for n in gm.graph.nodes]
    assert all(isinstance(c, NodeCost) for c in costs)
    assert sum(c.param_bytes for c in costs) == state_bytes(model)  # tied weights once
    actual = sum(saved_bytes_by_module(model, args).values())
    predicted = sum(c.saved_bytes for c in costs)
    assert abs(predicted - actual) <= 0.05 * actual, (predicted, actual)
    assert all(c.known for c in costs), sorted({c.op for c in costs if not c.known})


def test_input_not_mutated_and_deterministic() -> None:
    model, args = build("cnn")
    gm = shape_prop(trace(model, args), args)
    a, b = annotate_costs(gm, H100), annotate_costs(gm, H100)
    assert not any(COST.has(n) for n in gm.graph.nodes)
    assert [COST.get(n) for n in a.graph.nodes] == [COST.get(n) for n in b.graph.nodes]


def _node(gm: torch.fx.GraphModule, target: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target == target or n.name == target)


def test_hand_computed_flops() -> None:
    b = 4
    _, _, mlp = _costed("mlp", b)
    lin = COST.get(_node(mlp, "0"))
    assert (lin.fwd_flops, lin.bwd_flops) == (2 * b * 32 * 64, 2 * 2 * b * 32 * 64)
    assert lin.op == "linear" and lin.param_bytes == (32 * 64 + 64) * 4
    _, _, cnn = _costed("cnn", b)
    conv = COST.get(_node(cnn, "stem.0"))  # 3 -> 8 channels, 3x3, 16x16 output
    assert conv.fwd_flops == 2 * (b * 8 * 16 * 16) * (3 * 3 * 3)
    _, _, gpt = _costed("gpt", b)
    sdpa = COST.get(next(n for n in gpt.graph.nodes if "scaled_dot" in n.name))
    heads, t, hd = 4, 16, 8
    assert sdpa.op == "sdpa" and sdpa.fwd_flops == 2 * 2 * b * heads * t * t * hd
    head = COST.get(_node(gpt, "lm_head"))
    assert head.fwd_flops == 2 * b * t * 32 * 128 and head.param_bytes == 0  # tied: counted at wte
    _, _, bert = _costed("hf_bert", b)
    linear = COST.get(next(n for n in bert.graph.nodes if n.name == "linear"))
    assert linear.op == "linear" and linear.fwd_flops == 2 * b * 16 * 32 * 32


def test_saved_rules_on_a_small_block() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))
    x = torch.randn(5, 8)
    gm = annotate_costs(shape_prop(trace(model, (x,)), (x,)), H100)
    saved = {n.target: COST.get(n).saved_bytes for n in gm.graph.nodes if n.op == "call_module"}
    # linear saves its input; relu its output; the second linear reuses relu's output;
    # layernorm saves its input plus mean and rstd (5 rows, fp32)
    assert saved == {"0": 5 * 8 * 4, "1": 5 * 16 * 4, "2": 0, "3": 5 * 4 * 4 + 2 * 5 * 4}
    frozen = nn.Linear(8, 8).requires_grad_(False)
    gm = annotate_costs(shape_prop(trace(frozen, (x,)), (x,)), H100)
    assert sum(COST.get(n).saved_bytes for n in gm.graph.nodes) == 0  # nothing needs grad


class _Cached(nn.Module):
    """Keys concatenated behind an empty cache (Hugging Face's ``DynamicCache``): the cat
    carries the keys' gradient, so the scores' matmul saves both operands."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = torch.cat([x.new_zeros(x.shape[0], 0, 8), self.k(x)], dim=1)
        return torch.matmul(self.q(x), k.transpose(1, 2))


def test_a_concatenation_carries_the_gradient() -> None:
    model, x = _Cached(), torch.randn(2, 5, 8)
    gm = annotate_costs(shape_prop(trace(model, (x,)), (x,)), H100)
    predicted = sum(COST.get(n).saved_bytes for n in gm.graph.nodes)
    # x (both linears' input, once), q, and the copy of k^T the matmul makes
    assert predicted == sum(saved_bytes_by_module(model, (x,)).values()) == 3 * 2 * 5 * 8 * 4


@pytest.mark.parametrize("arch", ["swin", "vit", "mixtral", "gptj", "bloom", "falcon",
                                  "deberta_v2"])
def test_hugging_face_graphs_are_fully_costed(arch: str) -> None:
    """No op priced blind, and saved bytes as autograd keeps them running the traced graph
    (what a stage runs): Swin's window padding and symbolic index math, Mixtral's routing
    (``topk``, ``index_put``, transformers' grouped-matmul fallback), GPT-J's
    ``repeat_interleave``, BLOOM's ``baddbmm``, Falcon's transposed weights and the
    multi-query key and value a batched matmul copies at every head, DeBERTa-v2's
    ``gather`` (input and index kept) and ``sign`` / ``ceil`` index math.

    The traced graph, not the eager model, is the reference: export inlines BLOOM's GELU
    (a custom ``autograd.Function`` saving its input alone), so the graph keeps the seven
    tensors its ops save (2.3x the eager model's activations at this size)."""
    hf_zoo = pytest.importorskip("examples.models.hf_zoo")
    model, args = hf_zoo.build(arch, marked=False), hf_zoo.inputs(arch, 2)
    gm = shape_prop(trace(model, args), args)
    costs = [COST.get(n) for n in annotate_costs(gm, H100).graph.nodes]
    assert all(c.known for c in costs), sorted({c.op for c in costs if not c.known})
    actual = sum(saved_bytes_by_module(gm, args).values())
    assert abs(sum(c.saved_bytes for c in costs) - actual) <= 0.05 * actual


class _Reductions(nn.Module):
    """Reductions that keep their input, their result or their indices for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        top = h.topk(3, dim=-1).values.sum(-1, keepdim=True)
        spread = h.std(dim=-1, keepdim=True) + h.var(dim=-1, keepdim=True)
        out: torch.Tensor = h - h.max(dim=-1, keepdim=True).values + h.amax(-1, True) + top
        return out * spread


def test_reductions_keep_their_input_result_or_indices() -> None:
    """``max.dim`` / ``topk`` keep their indices, ``amax`` its input and result, ``std`` its
    input and result, ``var`` its input: priced as the traced graph's autograd keeps them."""
    x = torch.randn(4, 8)
    gm = shape_prop(trace(_Reductions(), (x,)), (x,))
    costs = [COST.get(n) for n in annotate_costs(gm, H100).graph.nodes]
    assert all(c.known for c in costs), sorted({c.op for c in costs if not c.known})
    assert sum(c.saved_bytes for c in costs) == sum(saved_bytes_by_module(gm, (x,)).values())


class _Opaque(nn.Module):
    """A user leaf with no formula: priced by running it on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_opaque_leaf_is_decomposed_on_fake_tensors() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Opaque())
    x = torch.randn(3, 4)
    gm = annotate_costs(shape_prop(trace(model, (x,), leaf_modules=(_Opaque,)), (x,)), H100)
    cost = COST.get(next(n for n in gm.graph.nodes if n.target == "1"))
    assert cost.known and cost.op == "module:_Opaque"
    assert cost.fwd_flops == 2 * 3 * 4 * 6 and cost.bwd_flops == 2 * cost.fwd_flops
    assert cost.saved_bytes == 3 * 4 * 4 + 3 * 6 * 4  # its input (for lin) + relu's output
    assert cost.param_bytes == (4 * 6 + 6) * 4


class _NeedsData(DataDependent):
    """Branches on its values and refuses all-zero ones: no run prices it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(x.any()):
            raise ValueError("all-zero input")
        return super().forward(x)


class _Counting(DataDependent):
    """Branches on its values, draws random numbers and counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(nn.functional.dropout(x, 0.5))


def _counting() -> tuple[nn.Module, torch.fx.GraphModule]:
    """A model whose first module is ``_Counting``, traced and shape-propagated (its weights
    are real: one real run for shapes)."""
    model = nn.Sequential(_Counting(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    return model, shape_prop(trace(model, (x,)), (x,))


def test_a_value_branching_leaf_is_decomposed_on_real_zeros(
        caplog: pytest.LogCaptureFixture) -> None:
    model, gm = _counting()
    rng, calls = torch.get_rng_state(), model[0].calls.clone()
    with caplog.at_level(logging.INFO, logger="smp_fx.cost"):
        out = annotate_costs(gm, H100)
    cost = COST.get(next(n for n in out.graph.nodes if n.target == "0"))
    assert cost.known and cost.op == "module:_Counting"
    assert cost.fwd_flops == 2 * 2 * 8 * 8 and cost.bwd_flops == 2 * 2 * 8 * 8  # no input grad
    assert any("real zeros" in r.getMessage() for r in caplog.records)
    # the model and its training are untouched: random state, buffers, gradients
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(model[0].calls, calls)
    assert all(p.grad is None for p in model.parameters())


def test_skip_tracing_leaves_a_value_branching_leaf_unknown() -> None:
    _, gm = _counting()
    out = annotate_costs(gm, H100, allow_real_run=False)
    assert not COST.get(next(n for n in out.graph.nodes if n.target == "0")).known


def test_unknown_op_marked_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(_NeedsData(), nn.Linear(8, 8), _NeedsData())
    x = torch.randn(2, 8)
    gm = shape_prop(trace(model, (x,)), (x,))
    annotate_costs_module._warned.discard("module:_NeedsData")
    with caplog.at_level(logging.WARNING, logger="smp_fx.cost"):
        out = annotate_costs(gm, H100)
        annotate_costs(gm, H100)
    unknown = [COST.get(n) for n in out.graph.nodes if n.op == "call_module" and n.target != "1"]
    assert [c.known for c in unknown] == [False, False]
    assert unknown[0].op == "module:_NeedsData" and unknown[0].fwd_flops == 0
    assert sum("module:_NeedsData" in r.getMessage() for r in caplog.records) == 1


def test_measured_numbers_replace_analytic_ones() -> None:
    model, args = build("mlp")
    gm = shape_prop(trace(model, args), args)
    out = annotate_costs(gm, H100, measured={"_0": (1.5, 2.5, 123)})
    cost = COST.get(_node(out, "_0"))
    assert (cost.fwd_time_s, cost.bwd_time_s, cost.saved_bytes, cost.measured) == (
        1.5, 2.5, 123, True)
    other = COST.get(_node(out, "_2"))
    assert not other.measured and other.fwd_time_s < 1e-3


def test_meta_model_is_costed_without_storage() -> None:
    with delay_param_initialization():
        model = example("gpt").build_model(n_layer=4, n_embd=64)
    args = example("gpt").example_inputs(2)
    gm = annotate_costs(shape_prop(trace(model, args), args), H100)
    assert all(p.is_meta for p in gm.parameters())
    assert sum(COST.get(n).param_bytes for n in gm.graph.nodes) == state_bytes(model)
    assert sum(COST.get(n).fwd_flops for n in gm.graph.nodes) > 0


def test_fx_graph_with_automatic_leaves_is_fully_costed() -> None:
    model, args = build("hf_bert")
    gm = annotate_costs(shape_prop(trace(model, args, frontend="fx"), args), H100)
    assert gm.meta["smp.auto_leaves"]  # BertEmbeddings / BertSelfAttention are opaque to fx
    costs = [COST.get(n) for n in gm.graph.nodes]
    assert all(c.known for c in costs)
    actual = sum(saved_bytes_by_module(model, args).values())
    assert abs(sum(c.saved_bytes for c in costs) - actual) <= 0.05 * actual
    assert sum(c.param_bytes for c in costs) == state_bytes(model)


def test_unmeasured_fields_keep_analytic_values() -> None:
    """trace_execution_times alone keeps analytic saved bytes; trace_memory_usage alone
    keeps analytic times."""
    model, args = build("mlp")
    gm = shape_prop(trace(model, args), args)
    analytic = COST.get(_node(annotate_costs(gm, H100), "_0"))
    times = COST.get(_node(annotate_costs(gm, H100, measured={"_0": (1.5, 2.5, None)}), "_0"))
    assert (times.fwd_time_s, times.bwd_time_s) == (1.5, 2.5)
    assert times.saved_bytes == analytic.saved_bytes and times.measured
    mem = COST.get(_node(annotate_costs(gm, H100, measured={"_0": (None, None, 7)}), "_0"))
    assert (mem.fwd_time_s, mem.bwd_time_s) == (analytic.fwd_time_s, analytic.bwd_time_s)
    assert mem.saved_bytes == 7


class _WithLoss(nn.Module):
    """A language-model head whose loss is inside the model, as Hugging Face's are when
    given labels: cross-entropy, or NLL over an explicit log-softmax."""

    def __init__(self, nll: bool) -> None:
        super().__init__()
        self.head, self.nll = nn.Linear(8, 50), nll

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(x).flatten(0, 1)
        if self.nll:
            return nn.functional.nll_loss(logits.log_softmax(-1), target.flatten())
        return nn.functional.cross_entropy(logits, target.flatten())


@pytest.mark.parametrize("nll", [False, True], ids=["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loss_inside_the_model_is_priced_and_keeps_what_autograd_keeps(
        nll: bool, dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    model = _WithLoss(nll).to(dtype)
    args = (torch.randn(3, 7, 8, dtype=dtype), torch.randint(0, 50, (3, 7)))
    with caplog.at_level(logging.WARNING, logger="smp_fx"):
        gm = annotate_costs(shape_prop(trace(model, args), args), H100)
    costs = {n.name: COST.get(n) for n in gm.graph.nodes}
    assert all(c.known for c in costs.values()), sorted(
        c.op for c in costs.values() if not c.known)
    assert not [r for r in caplog.records if "no formula" in r.getMessage()]
    loss = next(c for c in costs.values() if c.op in ("cross_entropy", "nll_loss"))
    assert loss.fwd_flops > 0
    actual = sum(saved_bytes_by_module(model, args).values())
    assert sum(c.saved_bytes for c in costs.values()) == actual
