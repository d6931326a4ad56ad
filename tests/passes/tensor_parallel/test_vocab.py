"""Vocabulary padding of vocab-parallel embeddings (``passes.tensor_parallel.vocab``), on one
process.

With no tensor-parallel group bound the collectives are the identity, so rank r's graph
returns rank r's part: its partial lookup (ids outside its rows give zeros; the ranks'
lookups sum to the full one) and its block of the tied LM head's logits (the ranks' blocks,
concatenated and cut to the vocabulary, are the full logits). A vocabulary the degree
does not divide is padded with zero rows, recorded in ``ShardSpec.pad`` and stripped by
``merge_shards``.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes.tensor_parallel import (
    ShardSpec,
    TensorParallelism,
    TensorParallelPlan,
    merge_shards,
    tensor_parallel,
)
from passes.trace import trace


class Tied(nn.Module):
    """A token embedding and the LM head tied to it (GPT's wte / lm_head), both outputs."""

    def __init__(self, vocab: int, dim: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.wte(ids), self.lm_head(h)


@pytest.mark.parametrize(("vocab", "size"), [(7, 2), (10, 3), (8, 2)])
def test_padded_vocabulary_ranks_sum_to_the_model(vocab: int, size: int) -> None:
    torch.manual_seed(0)
    model = Tied(vocab)
    ids = torch.arange(vocab).repeat(2).view(2, vocab)  # every row looked up
    h = torch.randn(2, 3, 4)
    gm = trace(model, (ids, h), {})
    rows = -(-vocab // size)
    lookups, logits, shards = [], [], []
    for rank in range(size):
        new, plan = tensor_parallel(gm, TensorParallelism(size, rank, True, ("lm_head", "wte")))
        assert plan.replicated == ()
        pad = rows * size - vocab
        assert plan.sharded == (ShardSpec("wte.weight", 0, size, (vocab, 4), pad=pad),
                                ShardSpec("lm_head.weight", 0, size, (vocab, 4), pad=pad))
        params = dict(new.named_parameters(remove_duplicate=False))
        assert params["wte.weight"] is params["lm_head.weight"]
        assert tuple(params["wte.weight"].shape) == plan.sharded[0].local_shape == (rows, 4)
        shards.append(params["wte.weight"].detach())
        e, y = new(ids, h)
        assert y.shape == (2, 3, rows)
        lookups.append(e)
        logits.append(y)
    full_e, full_y = model(ids, h)
    torch.testing.assert_close(sum(lookups), full_e, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat(logits, -1)[..., :vocab], full_y, atol=1e-6, rtol=1e-6)
    padded = torch.cat(shards)
    assert torch.count_nonzero(padded[vocab:]) == 0  # the padding rows are zeros
    if vocab % size:
        assert torch.count_nonzero(logits[-1][..., rows - (rows * size - vocab):]) == 0
    torch.testing.assert_close(merge_shards(plan.sharded[0], shards), model.wte.weight.detach(),
                               atol=0, rtol=0)


def test_pad_is_in_the_plan_json_only_when_set() -> None:
    padded = ShardSpec("wte.weight", 0, 2, (63, 32), pad=1)
    plain = ShardSpec("fc.weight", 0, 2, (64, 32))
    assert padded.to_json()["pad"] == 1 and "pad" not in plain.to_json()
    plan = TensorParallelPlan(2, (padded, plain))
    assert TensorParallelPlan.from_json(plan.to_json()) == plan
    assert padded.local_shape == (32, 32)


def test_padded_shard_is_what_the_plan_prices() -> None:
    """The embedding node's parameter bytes are one rank's padded shard."""
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(63, 8))
    import smp_fx as smp
    from smp_fx.marking.tensor_parallelism import marked_paths

    smp.set_tensor_parallelism(model[0])
    ids = torch.randint(0, 63, (2, 5))
    compiled = compile_model(model, (ids,), None, PartitionConfig(num_stages=1),
                             tp=TensorParallelism(2, 1, True, marked_paths(model)))
    from passes import meta

    [node] = [n for n in compiled.gm.graph.nodes if meta.TP.get(n) == "tp_vocab_embedding"]
    assert meta.COST.get(node).param_bytes == 32 * 8 * 4
    assert compiled.tp_plan.sharded[0].pad == 1


class LossInside(nn.Module):
    """The GPT-2-style example (vocabulary 63) with its loss computed in the forward:
    ``F.cross_entropy`` of the tied LM head's logits, flattened to tokens."""

    def __init__(self, vocab: int = 63, also_logits: bool = False) -> None:
        super().__init__()
        from tests.helpers.models import example

        self.gpt = example("gpt").build_model(vocab_size=vocab)
        self.also_logits = also_logits

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> object:
        logits = self.gpt(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=0)
        return (loss, logits) if self.also_logits else loss


def test_vocab_parallel_cross_entropy_is_the_plain_one_on_every_column() -> None:
    """Without a group the op covers the columns it is given: from column 0 with the
    padding column masked it is ``F.cross_entropy`` per token, ignored tokens 0, and its
    gradient is the plain one (zero on the padding column)."""
    from passes.tensor_parallel import loss as tp_loss

    torch.manual_seed(0)
    logits = torch.randn(6, 8) * 3
    target = torch.tensor([1, 6, 0, 3, -100, 2])
    got_x = logits.clone().requires_grad_()
    want_x = logits[:, :7].clone().requires_grad_()
    got = tp_loss.tp_vocab_cross_entropy(got_x, target, 0, 7)
    want = F.cross_entropy(want_x, target, reduction="none")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    weights = torch.arange(6.0)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert got_x.grad is not None and want_x.grad is not None
    torch.testing.assert_close(got_x.grad[:, :7], want_x.grad, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(got_x.grad[:, 7]) == 0
    for reduction in ("mean", "sum", "none"):
        torch.testing.assert_close(tp_loss.token_loss(got, target, reduction),
                                   F.cross_entropy(logits[:, :7], target, reduction=reduction),
                                   atol=1e-6, rtol=1e-6)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes]


@pytest.mark.parametrize("prescaled", [True, False])
def test_a_loss_of_the_vocab_logits_is_fused_and_the_logits_stay_split(prescaled: bool) -> None:
    import smp_fx as smp
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.marking.tensor_parallelism import marked_paths

    torch.manual_seed(0)
    for also_logits in (False, True):
        model = LossInside(also_logits=also_logits)
        smp.set_tensor_parallelism(model.gpt.wte)
        smp.set_tensor_parallelism(model.gpt.lm_head)
        ids = torch.randint(0, 63, (2, 16))
        compiled = compile_model(model, (ids, ids), None, PartitionConfig(num_stages=1),
                                 tp=TensorParallelism(2, 1, prescaled, marked_paths(model)))
        names = _targets(compiled.gm)
        if also_logits:  # the logits are an output too: gathered whole, the loss plain
            assert "tp_gather_last" in names and "cross_entropy" in names
            assert "tp_vocab_cross_entropy" not in names
            continue
        assert "tp_vocab_cross_entropy" in names and "token_loss" in names
        assert "tp_gather_last" not in names and "cross_entropy" not in names
        [ce] = [n for n in compiled.gm.graph.nodes if n.target is not None
                and getattr(n.target, "__name__", "") == "tp_vocab_cross_entropy"]
        assert ce.args[2:] == (32, 63, 0)  # rank 1's first column, the vocabulary, ignore
        assert names.count("tp_gather_batch") == (0 if prescaled else 3)  # ids, h, targets


class HFLoss(nn.Module):
    """The tiny HF GPT-2 (vocabulary 128) trained with ``labels=``: transformers computes
    the loss in the forward (``ForCausalLMLoss``: ``logits.float()``, labels padded with
    -100 and shifted, ``view(-1, V)``, ``cross_entropy(ignore_index=-100)``), the mean or,
    with ``num_items``, the sum divided by the count of labels not ignored."""

    def __init__(self, num_items: bool = False, vocab: int = 128) -> None:
        super().__init__()
        from tests.helpers.models import example

        self.model = example("hf_gpt2").build_model().model
        if vocab != 128:  # the same config, another vocabulary (GPT-2's 50257 is odd)
            config = self.model.config
            config.vocab_size, config.bos_token_id, config.eos_token_id = (vocab,) + (
                vocab - 1,) * 2
            self.model = type(self.model)(config).eval()
        self.num_items = num_items

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        extra = {"num_items_in_batch": (labels[:, 1:] != -100).sum()} if self.num_items else {}
        loss: torch.Tensor = self.model(input_ids=ids, labels=labels, use_cache=False,
                                        **extra).loss
        return loss


def hf_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels of ``ids`` with every third token ignored (-100)."""
    labels = ids.clone()
    labels.view(-1)[::3] = -100
    return labels


@pytest.mark.parametrize(("num_items", "prescaled"), [(False, True), (True, False)])
def test_a_hugging_face_loss_with_labels_is_fused(num_items: bool, prescaled: bool) -> None:
    """HF GPT-2 (torch.export graph) with its tied ``lm_head`` and ``transformer.wte``
    marked apart (not siblings: one region as they hold one tensor): the float cast, the
    view and ``aten.cross_entropy_loss`` become the fused loss on this rank's 64 columns,
    ignore_index -100 and the reduction kept (``sum`` then HF's division, or ``mean``)."""
    import smp_fx as smp
    from passes import meta
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.marking.tensor_parallelism import marked_paths

    torch.manual_seed(0)
    model = HFLoss(num_items)
    smp.set_tensor_parallelism(model.model.transformer.wte)
    smp.set_tensor_parallelism(model.model.lm_head)
    ids = torch.randint(0, 128, (2, 16))
    compiled = compile_model(model, (ids, hf_labels(ids)), None, PartitionConfig(num_stages=1),
                             tp=TensorParallelism(2, 1, prescaled, marked_paths(model)))
    plan = compiled.tp_plan
    assert plan.replicated == () and {s.name for s in plan.sharded} == {
        "model.lm_head.weight", "model.transformer.wte.weight"}
    names = _targets(compiled.gm)
    assert "tp_gather_last" not in names and "aten.cross_entropy_loss.default" not in names
    [ce] = [n for n in compiled.gm.graph.nodes
            if getattr(n.target, "__name__", "") == "tp_vocab_cross_entropy"]
    assert ce.args[2:] == (64, 128, -100)  # rank 1's first column, the vocabulary, ignore
    assert meta.TENSOR.get(ce.args[0]).shape == (32 * (1 if prescaled else 2), 64)
    [loss] = [n for n in compiled.gm.graph.nodes if getattr(n.target, "__name__", "") ==
              "token_loss"]
    assert loss.args[2:] == ("sum" if num_items else "mean", -100)
    assert [str(u.target) for u in loss.users] == (["aten.div.Tensor"] if num_items
                                                   else ["output"])


def test_an_embedding_tied_to_an_unmarked_head_stays_replicated() -> None:
    """HF GPT-2's ``transformer.wte`` marked without ``lm_head``: sharding the embedding
    alone would hand the unmarked head half the vocabulary rows, so the region stays
    replicated with the reason and the graph computes the model."""
    import smp_fx as smp
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.marking.tensor_parallelism import marked_paths

    torch.manual_seed(0)
    model = HFLoss()
    smp.set_tensor_parallelism(model.model.transformer.wte)
    ids = torch.randint(0, 128, (2, 16))
    labels = hf_labels(ids)
    compiled = compile_model(model, (ids, labels), None, PartitionConfig(num_stages=1),
                             tp=TensorParallelism(2, 1, True, marked_paths(model)))
    assert compiled.tp_plan.sharded == ()
    [(region, why)] = compiled.tp_plan.replicated
    assert region == "model.transformer.wte" and "sharding would untie them" in why
    torch.testing.assert_close(compiled.gm(ids, labels), model(ids, labels))


class CastLoss(LossInside):
    """``LossInside`` (torch.fx) with HF's loss written out: ``logits.float()``, a view to
    ``[tokens, V]``, ignore_index -100 and the sum over the tokens divided by their count."""

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> object:
        logits = self.gpt(ids).float().view(-1, 63)
        flat = targets.flatten()
        return F.cross_entropy(logits, flat, reduction="sum") / (flat != -100).sum()


@pytest.mark.parametrize("prescaled", [True, False])
def test_a_float_cast_before_the_loss_is_fused_on_the_fx_graph(prescaled: bool) -> None:
    """The cast of a padded vocabulary's logits (63 columns: the view cannot split them)
    makes the head lone, as without the cast, and the cast and view run on its columns."""
    import smp_fx as smp
    from passes import meta
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.marking.tensor_parallelism import marked_paths

    torch.manual_seed(0)
    model = CastLoss()
    smp.set_tensor_parallelism(model.gpt.wte)
    smp.set_tensor_parallelism(model.gpt.lm_head)
    ids = torch.randint(0, 63, (2, 16))
    compiled = compile_model(model, (ids, hf_labels(ids)), None, PartitionConfig(num_stages=1),
                             tp=TensorParallelism(2, 1, prescaled, marked_paths(model)))
    names = _targets(compiled.gm)
    assert "tp_gather_last" not in names and "cross_entropy" not in names
    [view] = [n for n in compiled.gm.graph.nodes if n.target == "view"
              and n.args[0].target == "float"]  # of the head's own (padded) 32 columns
    assert view.args[1:] == (-1, 32) and meta.TENSOR.get(view).shape == (32 * (
        1 if prescaled else 2), 32)
    [ce] = [n for n in compiled.gm.graph.nodes
            if getattr(n.target, "__name__", "") == "tp_vocab_cross_entropy"]
    assert ce.args[0].args[0].target == "float" and ce.args[2:] == (32, 63, -100)
