"""``passes.tensor_parallel`` on one process: pure, shards by rank, leaves what it cannot
shard replicated with the reason.

With no tensor-parallel group bound, the collectives are the identity, so rank r's graph
of a column -> row pair returns its partial sum plus the bias: the ranks' outputs summed
(bias counted once) equal the unsharded model's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.tensor_parallel.analysis import regions
from passes.trace import trace


class Pair(nn.Module):
    def __init__(self, inner: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(4, inner)
        self.down = nn.Linear(inner, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def test_ranks_hold_shards_and_sum_to_the_model() -> None:
    model = Pair()
    x = torch.randn(3, 4)
    gm = trace(model, (x,), {})
    before = [n.name for n in gm.graph.nodes], {k: v.shape for k, v in gm.state_dict().items()}
    outs = []
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, ("up", "down")))
        assert plan.pairs == (("up", "down"),) and plan.replicated == ()
        assert {s.name: s.dim for s in plan.sharded} == {"up.weight": 0, "up.bias": 0,
                                                         "down.weight": 1}
        assert new.state_dict()["up.weight"].shape == (4, 4)
        assert new.state_dict()["down.weight"].shape == (4, 4)
        outs.append(new(x))
    # pure: the input graph and its module are untouched
    assert ([n.name for n in gm.graph.nodes],
            {k: v.shape for k, v in gm.state_dict().items()}) == before
    assert model.up.weight.shape == (8, 4)
    torch.testing.assert_close(outs[0] + outs[1] - model.down.bias, model(x))


def test_what_cannot_be_sharded_stays_replicated_alone_with_the_reason() -> None:
    """``up`` has 7 outputs, which tp=2 does not divide: it stays whole, and so the region
    around it is not lost: ``down`` (now fed a replicated value) is a lone linear, its
    output gathered. The plan names the module, the node and why."""
    model = Pair(inner=7)
    x = torch.randn(3, 4)
    gm = shape_prop(trace(model, (x,), {}), (x,))
    outs = []
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, ("up", "down")))
        assert [m for m, _ in plan.replicated] == ["up"]
        assert "up.weight has 7 out features, not divisible by tensor_parallel_degree 2" in \
            plan.replicated[0][1]
        assert [m for m, _ in plan.lone] == ["down"] and "output" in plan.lone[0][1]
        assert {s.name for s in plan.sharded} == {"down.weight", "down.bias"}
        assert plan.elements == (4 * 7 + 4, 7 * 4 + 7 + 4 * 7 + 4)
        outs.append(new(x))  # no group bound: the gather is the identity, one half each
    torch.testing.assert_close(torch.cat(outs, -1), model(x))


def test_a_linear_applied_twice_is_sharded_once() -> None:
    """One layer called twice (ALBERT shares its layers across depth): both calls take
    the same role and read one shard."""
    shared = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(self.body(x))

    model = Twice()
    x = torch.randn(3, 4)
    gm = shape_prop(trace(model, (x,), {}), (x,))
    outs = []
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, ("body",)))
        assert plan.replicated == () and plan.lone == ()
        assert set(plan.pairs) == {("body.0", "body.2")}
        assert new.state_dict()["body.0.weight"].shape == (4, 4)
        outs.append(new)
    # each rank's graph sums its partial outputs per call: checked end to end on 2
    # processes (tests/smp_fx/parallel/test_tp_structures.py)


def test_regions_group_siblings_and_keep_the_outermost() -> None:
    assert regions(["a.fc1", "a.fc2", "a.fc1.x", "b"]) == [("b",), ("a.fc1", "a.fc2")]
    assert regions([""]) == [("",)]


def _attention_ranks(heads: int) -> tuple[list[torch.Tensor], torch.Tensor, tuple]:
    from examples.models.gpt import CausalSelfAttention, GPTConfig
    from passes.shape_prop import shape_prop

    torch.manual_seed(0)
    model = CausalSelfAttention(GPTConfig(n_embd=24, n_head=heads))
    x = torch.randn(2, 5, 24)
    gm = shape_prop(trace(model, (x,), {}), (x,))
    outs, plan = [], None
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, ("",)))
        outs.append(new(x) - model.c_proj.bias / 2)
    return outs, model(x), plan


def test_attention_splits_by_heads_with_the_fused_qkv_strided() -> None:
    outs, want, plan = _attention_ranks(heads=4)
    assert plan.replicated == () and plan.pairs == (("c_attn", "c_proj"),)
    assert {(s.name, s.dim, s.stride) for s in plan.sharded} == {
        ("c_attn.weight", 0, 3), ("c_attn.bias", 0, 3), ("c_proj.weight", 1, 1)}
    torch.testing.assert_close(outs[0] + outs[1], want)


def test_heads_not_divisible_by_tp_make_the_projections_lone() -> None:
    """3 heads at tp=2: the fused c_attn cannot split by heads, so it is a lone linear
    (sharded, output gathered), attention runs whole on every rank, and c_proj (fed a
    replicated value) is lone too; the plan says why. (Without a tp group the gathers
    are the identity, so the numerics are checked on 2 processes.)"""
    from examples.models.gpt import CausalSelfAttention, GPTConfig

    model = CausalSelfAttention(GPTConfig(n_embd=24, n_head=3))
    x = torch.randn(2, 5, 24)
    gm = shape_prop(trace(model, (x,), {}), (x,))
    _, plan = tensor_parallel(gm, TensorParallelism(2, 0, True, ("",)))
    assert plan.replicated == () and plan.pairs == ()
    assert [m for m, _ in plan.lone] == ["c_attn", "c_proj"]
    assert "view" in plan.lone[0][1] and "tp=2" in plan.lone[0][1]
    assert {s.name for s in plan.sharded} == {"c_attn.weight", "c_attn.bias",
                                              "c_proj.weight", "c_proj.bias"}


def test_strided_shards_merge_back() -> None:
    from passes.tensor_parallel import ShardSpec, merge_shards
    from passes.tensor_parallel.graph import shard as _shard

    full = torch.arange(24.0).reshape(12, 2)
    spec = ShardSpec("w", 0, 2, (12, 2), stride=3)
    assert ShardSpec.from_json(spec.to_json()) == spec
    shards = [_shard(full, 0, 2, r, 3) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]
    torch.testing.assert_close(merge_shards(spec, shards), full)


def test_a_linear_tied_to_an_embedding_stays_replicated_with_the_reason() -> None:
    """GPT's lm_head shares wte's weight: sharding it would untie the two, so the region
    stays replicated, the plan says why, and the tie is intact in the rewritten graph."""
    import smp_fx as smp
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.marking.tensor_parallelism import marked_paths
    from tests.helpers.models import example

    ex = example("gpt")
    torch.manual_seed(0)
    model = ex.build_model()
    smp.set_tensor_parallelism(model.lm_head)
    compiled = compile_model(model, ex.example_inputs(2), None, PartitionConfig(num_stages=1),
                             tp=TensorParallelism(2, 0, True, marked_paths(model)))
    assert compiled.tp_plan.sharded == ()
    assert compiled.tp_plan.replicated == (
        ("lm_head", "lm_head.weight is also read by wte (wte, in wte) (as wte.weight), which "
                    "the rewrite does not replace: sharding would untie them"),)
    params = dict(compiled.gm.named_parameters(remove_duplicate=False))
    assert params["lm_head.weight"] is params["wte.weight"]


def test_a_tied_embedding_and_lm_head_marked_together_share_one_vocab_shard() -> None:
    """Marked together, GPT's wte and lm_head are split by vocabulary rows: one shard
    Parameter under both names, a vocab-parallel lookup, the logits gathered; a degree
    that does not divide the vocabulary pads it."""
    import smp_fx as smp
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.marking.tensor_parallelism import marked_paths
    from tests.helpers.models import example

    ex = example("gpt")
    torch.manual_seed(0)
    model = ex.build_model()
    smp.set_tensor_parallelism(model.wte)
    smp.set_tensor_parallelism(model.lm_head)
    for size in (2, 3):
        compiled = compile_model(model, ex.example_inputs(2), None,
                                 PartitionConfig(num_stages=1),
                                 tp=TensorParallelism(size, 0, True, marked_paths(model)))
        params = dict(compiled.gm.named_parameters(remove_duplicate=False))
        if size == 3:  # 128 rows padded to 129: 43 per rank
            assert compiled.tp_plan.replicated == ()
            assert [s.pad for s in compiled.tp_plan.sharded] == [1, 1]
            assert tuple(params["wte.weight"].shape) == (43, 32)
            continue
        assert [s.name for s in compiled.tp_plan.sharded] == ["wte.weight", "lm_head.weight"]
        assert params["wte.weight"] is params["lm_head.weight"]
        assert tuple(params["wte.weight"].shape) == (64, 32)
        targets = [str(getattr(n.target, "__name__", n.target)) for n in compiled.gm.graph.nodes]
        assert "tp_vocab_embedding" in targets and "tp_gather_last" in targets


class Normed(nn.Module):
    """A full-width RMS norm between a pair (OLMo-2's q/k norm): its mean over the split
    features is completed by ``tp_sum``, and its ``rsqrt`` scales the split value."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_a_value_reduced_from_the_split_one_is_not_gathered_again() -> None:
    """With ``prescaled_batch`` false the pair runs on the tp group's gathered batch: only
    the pair's input is gathered; the norm's ``rsqrt``, computed from the split value,
    holds that batch already (gathered again, it held tp times the batch)."""
    model = Normed()
    x = torch.randn(2, 3, 4)
    gm = shape_prop(trace(model, (x,), {}), (x,))
    new, plan = tensor_parallel(gm, TensorParallelism(2, 0, False, ("up", "down")))
    assert plan.pairs == (("up", "down"),)
    gathers = [n for n in new.graph.nodes if n.name.startswith("tp_gather_batch")]
    assert [n.args[0].name for n in gathers] == ["x"]
