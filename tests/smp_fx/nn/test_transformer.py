"""``smp.nn``'s transformer modules: at tp=1 each computes the documented function (a
hand-written reference, or the GPT-2-style example with the same weights); traced by the
fx front end, the tp rewrite shards every linear (nothing left replicated), and with no
group bound the ranks' partial outputs sum to the module's; SMP's signatures and
defaults; unsupported options raise ``SMPNotImplementedError``."""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import smp_fx as smp
from examples.models.gpt import GPT, GPTConfig
from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.tensor_parallel import collectives as tp_collectives
from passes.tensor_parallel import loss as tp_loss
from passes.trace import trace
from smp_fx.marking.tensor_parallelism import is_marked, marked_paths

SMALL = {"num_attention_heads": 4, "attention_head_size": 4, "hidden_size": 16,
         "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}


def _ln(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps)


def _attention_ref(layer: Any, x: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool, source: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + masks) V, then dense, residual, layer norms; keys and
    values from ``source`` (cross attention, not normalised) when given."""
    h = _ln(x, layer.pre_layernorm) if layer.pre_layernorm is not None else x
    n, s, _ = x.shape
    heads, d = layer.num_attention_heads, layer.attention_head_size

    def split(lin: nn.Linear, inp: torch.Tensor) -> torch.Tensor:
        return (inp @ lin.weight.T + lin.bias).reshape(n, inp.shape[1], heads, d) \
            .permute(0, 2, 1, 3)

    kv = h if source is None else source
    q, k, v = split(layer.query, h), split(layer.key, kv), split(layer.value, kv)
    scores = q @ k.transpose(2, 3) / math.sqrt(d)
    if causal:
        later = torch.arange(s)[None, :] > torch.arange(s)[:, None]
        scores = scores.masked_fill(later, -10000.0)
    if mask is not None:
        scores = scores + mask
    ctx = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(n, s, heads * d)
    out = ctx @ layer.dense.weight.T + layer.dense.bias + x
    return _ln(out, layer.layernorm) if layer.layernorm is not None else out


@pytest.mark.parametrize(("pre", "post", "causal"), [(False, True, False), (True, False, True),
                                                     (True, True, True)])
def test_attention_layer_computes_masked_multi_head_attention(pre: bool, post: bool,
                                                              causal: bool) -> None:
    torch.manual_seed(0)
    layer = smp.nn.DistributedAttentionLayer(
        **(SMALL | {"num_attention_heads": 2, "attention_head_size": 6}), pre_layernorm=pre,
        post_layernorm=post, causal_mask_size=8 if causal else None,
        use_normal_initialization=True, initializer_range=0.3)
    assert is_marked(layer) and layer.query.weight.shape == (12, 16)
    x = torch.randn(3, 5, 16)
    mask = torch.zeros(3, 1, 1, 5)
    mask[1, ..., 3:] = -10000.0  # the second example's last two keys are padding
    torch.testing.assert_close(layer((x, mask)), _attention_ref(layer, x, mask, causal))
    torch.testing.assert_close(layer((x, None)), _attention_ref(layer, x, None, causal))


@pytest.mark.parametrize(("activation", "fn"), [("gelu", F.gelu), ("relu", F.relu)])
def test_output_layer_is_the_mlp_with_residual(activation: str, fn: Any) -> None:
    torch.manual_seed(0)
    layer = smp.nn.DistributedTransformerOutputLayer(16, 24, 0.0, activation,
                                                     pre_layernorm=True, post_layernorm=True)
    x = torch.randn(2, 3, 16)
    h = _ln(x, layer.pre_layernorm)
    inner = fn(h @ layer.dense1.weight.T + layer.dense1.bias)
    want = _ln(inner @ layer.dense2.weight.T + layer.dense2.bias + x, layer.layernorm)
    torch.testing.assert_close(layer(x), want)


def _gpt_and_lm_head(**extra: Any) -> tuple[GPT, Any]:
    """The GPT-2-style example and a pre-layernorm LM head holding its weights."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=4, vocab_size=32, seq_len=8))
    lm = smp.nn.DistributedTransformerLMHead(
        num_layers=2, **SMALL, intermediate_size=64, vocab_size=32, num_positions=8,
        causal_mask_size=8, pre_layernorm=True, post_layernorm=False, **extra)
    pairs = [(lm.word_embedding, gpt.wte), (lm.position_embedding, gpt.wpe),
             (lm.layernorm, gpt.ln_f)]
    for layer, block in zip(lm.transformer.seq_layers, gpt.h):
        att, out = layer.attention, layer.output
        pairs += [(att.pre_layernorm, block.ln_1), (att.dense, block.attn.c_proj),
                  (out.pre_layernorm, block.ln_2), (out.dense1, block.mlp.c_fc),
                  (out.dense2, block.mlp.c_proj)]
        for i, lin in enumerate((att.query, att.key, att.value)):
            with torch.no_grad():
                lin.weight.copy_(block.attn.c_attn.weight.chunk(3)[i])
                lin.bias.copy_(block.attn.c_attn.bias.chunk(3)[i])
    with torch.no_grad():
        for mine, theirs in pairs:
            for name, p in mine.named_parameters():
                p.copy_(theirs.get_parameter(name))
    return gpt, lm


def test_layer_transformer_and_lm_head_equal_the_gpt_example() -> None:
    """pre_layernorm, no post_layernorm, causal: GPT-2's block; the LM head adds GPT-2's
    final layer norm and ties its projection to the word embedding."""
    gpt, lm = _gpt_and_lm_head()
    assert lm.lm_head.weight is lm.word_embedding.weight
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(lm((ids,)), gpt(ids))
    x = torch.randn(2, 8, 16)
    hidden, mask = lm.transformer.seq_layers[0]((x, None))
    assert mask is None
    torch.testing.assert_close(hidden, gpt.h[0](x))
    hidden, _ = lm.transformer((x, None))
    torch.testing.assert_close(hidden, gpt.h[1](gpt.h[0](x)))


def test_lm_head_mask_positions_types_and_without_head() -> None:
    """SMP's 0-1 mask (1 = masked): padded keys change nothing for the others; token
    types and position ids add their rows; add_lm_head=False gives the hidden states."""
    torch.manual_seed(0)
    lm = smp.nn.DistributedTransformerLMHead(num_layers=1, **SMALL, intermediate_size=32,
                                             vocab_size=32, num_positions=8, num_token_types=2)
    ids = torch.randint(0, 32, (2, 6))
    pad = torch.zeros(2, 6)
    pad[:, 4:] = 1.0
    torch.testing.assert_close(lm((ids, pad))[:, :4], lm((ids[:, :4],))[:, :4])
    assert not torch.allclose(lm((ids, None))[:, :4], lm((ids[:, :4],))[:, :4])
    types, pos = torch.randint(0, 2, (2, 6)), torch.randint(0, 8, (2, 6))
    base = lm.word_embedding(ids) + lm.position_embedding.weight[pos] \
        + lm.token_type_embedding.weight[types]
    want = lm.transformer((base, None))[0] @ lm.word_embedding.weight.T
    torch.testing.assert_close(lm((ids, None, types, pos)), want)
    # without a token-type table the types are word-embedding rows (SMP's, HF GPT-2's)
    plain = smp.nn.DistributedTransformerLMHead(num_layers=1, **SMALL, intermediate_size=32,
                                                vocab_size=32, num_positions=8)
    base = plain.word_embedding(ids) + plain.word_embedding(types) \
        + plain.position_embedding.weight[:6]
    want = plain.transformer((base, None))[0] @ plain.word_embedding.weight.T
    torch.testing.assert_close(plain((ids, None, types)), want)
    bare = smp.nn.DistributedTransformerLMHead(num_layers=1, **SMALL, intermediate_size=32,
                                               vocab_size=32, num_positions=8,
                                               add_lm_head=False)
    assert bare.lm_head is None and bare((ids,)).shape == (2, 6, 16)


class _Wrap(nn.Module):
    """A user's model around the LM head: builds the tuple its forward takes."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lm((ids, mask))


def _ranks(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[list[Any], Any]:
    gm = shape_prop(trace(model, inputs, {}, frontend="fx"), inputs)
    outs, plan = [], None
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, marked_paths(model)))
        outs.append(new(*inputs) if rank == 0 or plan.sharded else None)
    return outs, plan


def test_lm_head_is_sharded_whole_by_the_rewrite() -> None:
    """Every linear in a pair (attention by heads, the MLP), the tied word embedding and
    LM head by vocabulary rows; the small position table stays whole; the padding mask
    is gathered with the batch."""
    _, lm = _gpt_and_lm_head()
    model = _Wrap(lm)
    ids, mask = torch.randint(0, 32, (2, 8)), torch.zeros(2, 8)
    gm = shape_prop(trace(model, (ids, mask), {}, frontend="fx"), (ids, mask))
    assert gm.meta["smp.auto_leaves"] == ()
    new, plan = tensor_parallel(gm, TensorParallelism(2, 1, False, marked_paths(model)))
    assert plan.replicated == ()
    # prescaled_batch false: the padding mask joins the gathered batch once, for both layers
    [mask_gather] = [n for n in new.graph.nodes if n.target is tp_collectives.tp_gather_batch
                     and n.args[0].target is operator.mul]
    assert len(mask_gather.users) == 2
    dims = {s.name: s.dim for s in plan.sharded}
    weights = {n for n, _ in model.named_parameters(remove_duplicate=False)
               if n.endswith(("query.weight", "key.weight", "value.weight", "dense1.weight",
                              "dense.weight", "dense2.weight"))}
    assert weights <= set(dims) and len(weights) == 12
    assert dims["lm.word_embedding.weight"] == 0 and dims["lm.lm_head.weight"] == 0
    assert dims["lm.transformer.seq_layers.1.attention.dense.weight"] == 1
    assert "lm.position_embedding.weight" not in dims
    assert ("lm.transformer.seq_layers.0.output.dense1",
            "lm.transformer.seq_layers.0.output.dense2") in plan.pairs


@pytest.mark.parametrize("which", ["attention", "cross", "output"])
def test_rank_partials_sum_to_the_layer(which: str) -> None:
    """pre_layernorm only: each rank returns its heads' (features') partial sum + bias +
    the residual, so the two ranks' outputs less one bias and one residual are the
    layer's output (cross attention: keys / values from the cross states)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    if which == "cross":
        layer = smp.nn.DistributedAttentionLayer(**SMALL, cross_attention=True,
                                                 pre_layernorm=True, post_layernorm=False)
        _, cross, mask, cmask = _cross_inputs(2)
        inputs, model = (x, cross, mask, cmask), _PassAll(layer)
    elif which == "attention":
        layer: nn.Module = smp.nn.DistributedAttentionLayer(
            **SMALL, causal_mask_size=5, pre_layernorm=True, post_layernorm=False)
        mask = torch.zeros(2, 1, 1, 5)
        mask[0, ..., 4] = -10000.0
        inputs: tuple[torch.Tensor, ...] = (x, mask)
        model: nn.Module = _Pass(layer)
    else:
        layer = smp.nn.DistributedTransformerOutputLayer(16, 32, 0.0, "relu",
                                                         pre_layernorm=True,
                                                         post_layernorm=False)
        inputs, model = (x,), layer
    outs, plan = _ranks(model, inputs)
    assert plan.replicated == () and len(plan.pairs) == (1 if which == "output" else 3)
    bias = layer.dense2.bias if which == "output" else layer.dense.bias
    torch.testing.assert_close(outs[0] + outs[1] - bias - x, model(*inputs))


class _Pass(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer((x, mask))


class _PassAll(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *items: torch.Tensor) -> Any:
        return self.layer(items)


def test_smp_signatures_and_defaults() -> None:
    layer_args = {"num_attention_heads": 32, "attention_head_size": 32, "hidden_size": 1024,
                  "intermediate_size": 4096, "attention_dropout_prob": 0.1,
                  "hidden_dropout_prob": 0.1, "activation": "gelu", "layernorm_epsilon": 1e-5,
                  "initializer_range": 0.02, "use_normal_initialization": False,
                  "causal_mask_size": None, "add_cross_attention": False,
                  "pre_layernorm": False, "post_layernorm": True}

    later = {"scale_attention_scores": True, "fp32_residual_addition": False,  # SMP 1.13-1.15
             "use_alibi": False, "alibi_bias_max": 8}

    def defaults(cls: type) -> dict[str, Any]:
        return {k: p.default for k, p in inspect.signature(cls).parameters.items()}

    # smp-fx's keyword-only options, for SMP's GPT-J / GPT-Neo / GPT-NeoX replacements
    layer_extra = {"parallel_attention_mlp": False, "shared_layernorm": False,
                   "attention_options": inspect.Parameter.empty}
    stack_extra = {"layer_options": None}
    assert defaults(smp.nn.DistributedTransformerLayer) == {**layer_args, **later,
                                                            **layer_extra}
    assert defaults(smp.nn.DistributedTransformer) == {"num_layers": 12, **layer_args,
                                                       **later, **stack_extra}
    head = {"num_layers": 12, **layer_args, "vocab_size": 30522, "num_positions": 1024,
            "num_token_types": 0, "add_lm_head": True, **later, **stack_extra}
    assert defaults(smp.nn.DistributedTransformerLMHead) == head
    att = defaults(smp.nn.DistributedAttentionLayer)
    assert att["cross_attention"] is False and att["hidden_size"] == 1024
    assert list(defaults(smp.nn.DistributedTransformerOutputLayer)) == [
        "hidden_size", "intermediate_size", "hidden_dropout_prob", "activation",
        "layernorm_epsilon", "initializer_range", "use_normal_initialization",
        "pre_layernorm", "post_layernorm", "fp32_residual_addition"]


def test_scale_attention_scores_and_fp32_residual_addition() -> None:
    """``scale_attention_scores=False`` leaves the scores unscaled (the same layer with
    queries scaled by sqrt(d) computes it); ``fp32_residual_addition`` sums in fp32."""
    torch.manual_seed(0)
    kw = {"num_attention_heads": 2, "attention_head_size": 4, "hidden_size": 8,
          "intermediate_size": 16, "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}
    plain = smp.nn.DistributedTransformerLayer(**kw)
    unscaled = smp.nn.DistributedTransformerLayer(**kw, scale_attention_scores=False)
    unscaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        unscaled.attention.query.weight.div_(2.0)  # sqrt(head size 4)
        unscaled.attention.query.bias.div_(2.0)
    x, mask = torch.randn(2, 3, 8), torch.zeros(2, 1, 1, 3)
    torch.testing.assert_close(unscaled((x, mask))[0], plain((x, mask))[0])
    out16 = smp.nn.DistributedTransformerOutputLayer(8, 16, 0.0, fp32_residual_addition=True)
    ref16 = smp.nn.DistributedTransformerOutputLayer(8, 16, 0.0)
    ref16.load_state_dict(out16.state_dict())
    torch.testing.assert_close(out16(x), ref16(x))  # fp32 activations: the same numbers
    assert out16.half()(x.half()).dtype == torch.float16
    with pytest.raises(smp.SMPNotImplementedError, match="use_alibi"):
        smp.nn.DistributedTransformer(num_layers=1, **kw, use_alibi=True)


@pytest.mark.parametrize("build", [
    lambda: smp.nn.DistributedTransformerOutputLayer(16, 32, activation="swish"),
], ids=["activation"])
def test_unsupported_options_raise_not_implemented(build: Any) -> None:
    with pytest.raises(smp.SMPNotImplementedError):
        build()


def test_default_layout_transformer_is_sharded_whole() -> None:
    """SMP's default layout (post layer norms, no causal mask, relu) shards the same:
    three heads pairs and one MLP pair per layer, nothing replicated."""
    torch.manual_seed(0)
    body = smp.nn.DistributedTransformer(num_layers=2, **SMALL, intermediate_size=32,
                                         activation="relu")
    model = _Pass(body)
    x, mask = torch.randn(2, 5, 16), torch.zeros(2, 1, 1, 5)
    torch.testing.assert_close(model(x, mask)[0], body.seq_layers[1](body.seq_layers[0](
        (x, mask)))[0])
    gm = shape_prop(trace(model, (x, mask), {}, frontend="fx"), (x, mask))
    _, plan = tensor_parallel(gm, TensorParallelism(2, 0, True, marked_paths(model)))
    assert plan.replicated == () and len(plan.pairs) == 8 and len(plan.sharded) == 20


def _cross_inputs(n: int = 3, s: int = 5, sc: int = 7) -> tuple[torch.Tensor, ...]:
    """Hidden states, cross states (another length), an additive self mask and a cross
    mask that pads the second example's last three cross positions."""
    x, cross = torch.randn(n, s, 16), torch.randn(n, sc, 16)
    mask, cmask = torch.zeros(n, 1, 1, s), torch.zeros(n, 1, 1, sc)
    mask[0, ..., s - 1] = -10000.0
    cmask[1, ..., sc - 3:] = -10000.0
    return x, cross, mask, cmask


@pytest.mark.parametrize(("pre", "post"), [(False, True), (True, False)])
def test_cross_attention_layer_attends_to_the_cross_states(pre: bool, post: bool) -> None:
    """Queries from the hidden states (pre-normalised), keys and values from the cross
    states as given, masked by the cross mask; the self mask is not used."""
    torch.manual_seed(0)
    layer = smp.nn.DistributedAttentionLayer(**SMALL, cross_attention=True,
                                             pre_layernorm=pre, post_layernorm=post)
    x, cross, mask, cmask = _cross_inputs()
    want = _attention_ref(layer, x, cmask, False, source=cross)
    torch.testing.assert_close(layer((x, cross, mask, cmask)), want)
    torch.testing.assert_close(layer((x, cross, None, cmask)), want)
    torch.testing.assert_close(layer((x, cross, mask, None)),
                               _attention_ref(layer, x, None, False, source=cross))
    with pytest.raises(smp.SMPConfigError, match="causal"):
        smp.nn.DistributedAttentionLayer(**SMALL, cross_attention=True, causal_mask_size=4)


def test_cross_layer_and_transformer_thread_the_four_items() -> None:
    """Self attention (causal), cross attention, MLP; the tuple passes through."""
    torch.manual_seed(0)
    body = smp.nn.DistributedTransformer(num_layers=2, **SMALL, intermediate_size=32,
                                         causal_mask_size=5, add_cross_attention=True,
                                         pre_layernorm=True, post_layernorm=True)
    x, cross, mask, cmask = _cross_inputs()
    h = x
    for i, layer in enumerate(body.seq_layers):
        assert layer.crossattention.causal_mask_size is None
        # SMP's layout with both layer norms: pre layer norms everywhere, one post layer
        # norm, on the last layer's output
        assert layer.attention.layernorm is None and layer.crossattention.layernorm is None
        assert (layer.output.layernorm is not None) == (i == len(body.seq_layers) - 1)
        h = _attention_ref(layer.attention, h, mask, True)
        h = _attention_ref(layer.crossattention, h, cmask, False, source=cross)
        out = layer.output
        inner = F.gelu(_ln(h, out.pre_layernorm) @ out.dense1.weight.T + out.dense1.bias)
        h = inner @ out.dense2.weight.T + out.dense2.bias + h
        h = h if out.layernorm is None else _ln(h, out.layernorm)
    got = body((x, cross, mask, cmask))
    assert len(got) == 4 and all(a is b for a, b in zip(got[1:], (cross, mask, cmask)))
    torch.testing.assert_close(got[0], h)
    assert smp.nn.DistributedTransformerLayer(**SMALL).crossattention is None


def _shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face GPT-2's: drop the last logits and the first labels."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def test_lm_head_labels_give_the_shifted_loss() -> None:
    """labels (item 5): the next-token loss of the GPT-2 example's logits; -100 ignored."""
    gpt, lm = _gpt_and_lm_head()
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    labels[0, 5:] = -100
    torch.testing.assert_close(lm((ids, None, None, None, labels)),
                               _shifted_loss(gpt(ids), labels))
    torch.testing.assert_close(lm((ids, None, None, None, None)), gpt(ids))
    with pytest.raises(smp.SMPConfigError, match="add_lm_head"):
        smp.nn.DistributedTransformerLMHead(num_layers=1, **SMALL, vocab_size=32,
                                            num_positions=8, add_lm_head=False)(
            (ids, None, None, None, labels))


def _cross_lm() -> nn.Module:
    torch.manual_seed(0)
    return smp.nn.DistributedTransformerLMHead(
        num_layers=2, **SMALL, intermediate_size=32, vocab_size=32, num_positions=8,
        causal_mask_size=8, add_cross_attention=True, pre_layernorm=True,
        post_layernorm=False, use_normal_initialization=True)


def test_lm_head_with_cross_attention_and_labels() -> None:
    """(ids, mask, types, positions, cross_states, cross_mask, labels): the 0-1 masks
    made additive, the cross states reach every layer, the loss is the shifted one."""
    lm = _cross_lm()
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    pad, cpad = torch.zeros(2, 8), torch.zeros(2, 6)
    pad[1, 6:], cpad[0, 4:] = 1.0, 1.0
    cross = torch.randn(2, 6, 16)
    x = lm.word_embedding(ids) + lm.position_embedding.weight[:8]
    hidden = lm.transformer((x, cross, pad[:, None, None, :] * -10000.0,
                             cpad[:, None, None, :] * -10000.0))[0]
    logits = _ln(hidden, lm.layernorm) @ lm.word_embedding.weight.T
    torch.testing.assert_close(lm((ids, pad, None, None, cross, cpad)), logits)
    torch.testing.assert_close(lm((ids, pad, None, None, cross, cpad, labels)),
                               _shifted_loss(logits, labels))
    assert not torch.allclose(lm((ids, pad, None, None, cross)), logits)  # cross mask used
    with pytest.raises(smp.SMPConfigError, match="cross_states"):
        lm((ids, pad))


class _CrossLM(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, cross: torch.Tensor, cmask: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        return self.lm((ids, None, None, None, cross, cmask, labels))


@pytest.mark.parametrize("prescaled", [True, False])
def test_cross_lm_head_is_sharded_whole_and_its_loss_fused(prescaled: bool) -> None:
    """Cross attention splits by heads like self attention (its key / value read the
    replicated cross states): 7 pairs a layer, nothing replicated; the labels' loss of
    the tied head's logits becomes the vocab-parallel cross entropy (no logits gather)."""
    model = _CrossLM(_cross_lm())
    inputs = (torch.randint(0, 32, (2, 8)), torch.randn(2, 6, 16), torch.zeros(2, 6),
              torch.randint(0, 32, (2, 8)))
    gm = shape_prop(trace(model, inputs, {}, frontend="fx"), inputs)
    new, plan = tensor_parallel(gm, TensorParallelism(2, 1, prescaled, marked_paths(model)))
    assert plan.replicated == () and len(plan.pairs) == 14 and len(plan.sharded) == 36
    prefix = "lm.transformer.seq_layers.1.crossattention"
    assert {(f"{prefix}.{lin}", f"{prefix}.dense") for lin in ("query", "key", "value")} \
        <= set(plan.pairs)
    targets = [n.target for n in new.graph.nodes if n.op == "call_function"]
    assert tp_loss.tp_vocab_cross_entropy in targets and F.cross_entropy not in targets
    assert tp_collectives.tp_gather_last not in targets
