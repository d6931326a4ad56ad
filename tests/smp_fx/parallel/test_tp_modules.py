"""``smp.nn.DistributedTransformerLMHead`` at tp=2 on 2 gloo ranks equals one process.

A tiny LM head (2 layers, hidden 16, 4 heads, vocab 32, sequence 8; GPT-2's layout:
pre-layernorm, causal) inside a user's model that builds its input tuple, trained 3 Adam
steps by ``smp.step``: the loss, the gradients (shards all-gathered by their specs) and
the parameters after the steps equal the unpartitioned model's on one process (fp32;
``tests/smp_fx/parallel/test_tensor_parallel.py``'s helpers and tolerances). The rewrite
shards every linear and the tied word embedding / LM head, and leaves nothing replicated.

Cases: ``prescaled_batch`` true with a padding mask (SMP's 0-1, 1 = masked), and false
(each rank its own examples, gathered over the tp group) with a padding mask; the LM head
with cross attention over a second sequence (its own padding mask) and ``labels``, whose
loss the model computes (fused into the vocab-parallel cross entropy under tp); and
``smp.tp_register``: a user's module registered with ``DistributedTransformer`` (hooks),
marked, replaced by ``DistributedModel`` and sharded, against one process running the
same replacement.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import smp_fx as smp
from passes.tensor_parallel import loss as tp_loss
from smp_fx.marking.tp_register import replace_registered
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.reference import train_plain
from tests.smp_fx.parallel.test_tensor_parallel import ADAM_EPS, STEPS, TOL, _gathered

GLOBAL_BATCH = 8
SEQ, VOCAB = 8, 32
TINY: dict[str, Any] = {
    "num_layers": 2, "num_attention_heads": 4, "attention_head_size": 4, "hidden_size": 16,
    "intermediate_size": 32, "vocab_size": VOCAB, "num_positions": SEQ,
    "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0, "causal_mask_size": SEQ,
    "pre_layernorm": True, "post_layernorm": False, "use_normal_initialization": True}
"""The LM heads of both models: 2 layers, hidden 16, 4 heads, vocabulary 32."""


class LM(nn.Module):
    """The user's model: builds SMP's ``(input_ids, attention_mask)`` tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = smp.nn.DistributedTransformerLMHead(**TINY)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm((input_ids, attention_mask))


class CrossLM(nn.Module):
    """The user's model: the LM head with cross attention, given labels, returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = smp.nn.DistributedTransformerLMHead(**TINY, add_cross_attention=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                cross_states: torch.Tensor, cross_mask: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        return self.lm((input_ids, attention_mask, None, None, cross_states, cross_mask,
                        labels))


@smp.tp_register(smp.nn.DistributedTransformer,
                 init_hook=lambda config: ((), config),
                 forward_hook=lambda x, mask: (((x, mask),), {}),
                 return_hook=lambda out: out[0])
class UserBlocks(nn.Module):
    """A user's transformer body with its own interface, registered (SMP's example)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.fc = nn.Linear(config["hidden_size"], config["hidden_size"])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Registered(nn.Module):
    """``UserBlocks`` marked: DistributedModel swaps in a DistributedTransformer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        with smp.tensor_parallelism():
            self.body = UserBlocks({"num_layers": 2, "num_attention_heads": 4,
                                    "attention_head_size": 4, "hidden_size": 16,
                                    "intermediate_size": 32, "attention_dropout_prob": 0.0,
                                    "hidden_dropout_prob": 0.0, "causal_mask_size": SEQ,
                                    "use_normal_initialization": True})
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        additive = attention_mask[:, None, None, :] * -10000.0
        return self.head(self.body(self.emb(input_ids), additive))


def _build(kind: str) -> nn.Module:
    """The model as the user builds it, and, for the reference, with the registered
    module replaced as DistributedModel does (the same random draws)."""
    torch.manual_seed(0)
    return {"lm": LM, "cross": CrossLM, "registered": Registered}[kind]()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1234)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ))
        mask = torch.zeros(GLOBAL_BATCH, SEQ)
        mask[1::2, 6:] = 1.0  # every other example ends in two padding tokens
        out.append((ids, mask, torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ))))
    return out


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


CROSS_SEQ = 6


def _cross(step: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s cross states and 0-1 cross mask (every third example's last two
    cross positions padded), from their own generator (the batches' draws unchanged)."""
    g = torch.Generator().manual_seed(99 + step)
    states = torch.randn(GLOBAL_BATCH, CROSS_SEQ, 16, generator=g)
    mask = torch.zeros(GLOBAL_BATCH, CROSS_SEQ)
    mask[::3, CROSS_SEQ - 2:] = 1.0
    return states[rows], mask[rows]


def _forward(kind: str, model: Any, step: int, rows: slice, ids: torch.Tensor,
             mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of the examples ``rows``: the model's own (labels) or the caller's."""
    if kind != "cross":
        return _loss(model(ids[rows], mask[rows]), y[rows])
    labels = ids[rows].masked_fill(mask[rows] > 0, -100)  # padding is not predicted
    return model(ids[rows], mask[rows], *_cross(step, rows), labels)


def _reference(kind: str, batch: int) -> tuple[list[float], list[dict[str, torch.Tensor]],
                                               dict[str, torch.Tensor]]:
    model = replace_registered(_build(kind))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    run = train_plain(model, opt, enumerate(_batches()), lambda m, b: _forward(
        kind, m, b[0], slice(0, batch), *b[1]))
    return run.losses, run.grads, run.params


_ORIGINAL = tp_loss.tp_vocab_cross_entropy
WIDTHS: list[int] = []


def _spy(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    """The fused loss, recording the width of the logits it sees (this rank's columns)."""
    WIDTHS.append(int(logits.shape[-1]))
    return _ORIGINAL(logits, *args)


def _checked(kind: str, prescaled: bool) -> dict[str, Any]:
    share = GLOBAL_BATCH // 2
    ref_losses, ref_grads, ref_params = _reference(kind, share if prescaled else GLOBAL_BATCH)
    tp_loss.tp_vocab_cross_entropy = _spy  # type: ignore[assignment]  # (this rank process)
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": prescaled, "microbatches": 2})
    model = smp.DistributedModel(_build(kind))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor,
                   cross: torch.Tensor, cross_mask: torch.Tensor) -> Any:
        if kind == "cross":
            loss = model(ids, mask, cross, cross_mask, ids.masked_fill(mask > 0, -100))
        else:
            loss = _loss(model(ids, mask), y)
        model.backward(loss)
        return loss

    lo = 0 if prescaled else smp.tp_rank() * share
    losses, bad = [], []
    for step, (ids, mask, y) in enumerate(_batches()):
        part = slice(lo, lo + share)
        losses.append(train_step(model, ids[part], mask[part], y[part],
                                 *_cross(step, part)).reduce_mean().item())
        got = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()})
        bad += [f"grad {n} step {step}" for n in mismatched(got, ref_grads[step], **TOL)]
        opt.step()
        opt.zero_grad()
    params = _gathered(model, {n: p.detach() for n, p in model.local_named_parameters()})
    for values in (params, ref_params):  # the key bias's true gradient is 0 (softmax
        for n in [n for n in values if n.endswith("key.bias")]:  # ignores it): Adam
            del values[n]  # turns its rounding into full steps; its gradient is compared
    bad += [f"param {n}" for n in mismatched(params, ref_params, atol=1e-4, rtol=1e-4)]
    if prescaled and not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses),
                                        atol=1e-5, rtol=1e-5):
        bad.append(f"loss {losses} != {ref_losses}")
    plan = model.tp_plan
    return {"bad": bad, "losses": losses, "replicated": plan.replicated, "widths": WIDTHS,
            "sharded": sorted(s.name for s in plan.sharded),
            "local": {n: tuple(p.shape) for n, p in model.local_named_parameters()}}


_RESULTS: dict[tuple[str, bool], list[Any]] = {}


def _run(kind: str, prescaled: bool) -> list[Any]:
    if (kind, prescaled) not in _RESULTS:
        _RESULTS[kind, prescaled] = run_ranks(_checked, 2, kind, prescaled, timeout=180,
                                              env={"SMP_FX_DEVICE_SPEC": "a100"})
    return _RESULTS[kind, prescaled]


@pytest.mark.multiproc
@pytest.mark.parametrize("prescaled", [True, False])
def test_lm_head_tp2_matches_single_process(prescaled: bool) -> None:
    results = _run("lm", prescaled)
    for res in results:
        assert res["bad"] == []
        assert res["replicated"] == ()
    res = results[0]
    assert res["local"]["lm.word_embedding.weight"] == (VOCAB // 2, 16)
    assert res["local"]["lm.transformer.seq_layers.0.attention.query.weight"] == (8, 16)
    assert res["local"]["lm.transformer.seq_layers.1.output.dense2.weight"] == (16, 16)
    assert res["local"]["lm.position_embedding.weight"] == (SEQ, 16)
    assert len(res["sharded"]) == 22  # 2 x (q, k, v: weight + bias; dense; dense1 w + b;
    # dense2) + the word embedding and its tied LM head
    if not prescaled:  # each rank's loss is its own examples'; their mean is the global
        mean = torch.tensor([results[0]["losses"], results[1]["losses"]]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(_reference("lm", GLOBAL_BATCH)[0]),
                                   **TOL)


@pytest.mark.multiproc
def test_registered_module_tp2_matches_single_process() -> None:
    """smp.tp_register end to end: the marked UserBlocks becomes a DistributedTransformer
    (init / forward / return hooks) that the rewrite shards; training equals one process
    running the same replacement."""
    for res in _run("registered", True):
        assert res["bad"] == [] and res["replicated"] == ()
        assert "body.fc.weight" not in res["local"]
        assert res["local"]["body.seq_layers.0.attention.key.weight"] == (8, 16)
        assert len(res["sharded"]) == 20 and not any(n.startswith(("emb", "head"))
                                                      for n in res["sharded"])


@pytest.mark.multiproc
@pytest.mark.parametrize("prescaled", [True, False])
def test_cross_attention_lm_head_with_labels_tp2_matches_single_process(prescaled: bool
                                                                         ) -> None:
    """Cross attention and labels at tp=2: the loss the model computes, the gathered
    gradients and the parameters after 3 Adam steps equal one process; the cross
    attention is sharded by heads like self attention (7 pairs a layer, nothing
    replicated) and the loss is the fused vocab-parallel cross entropy. With
    ``prescaled_batch`` false each half has as many ignored labels, so the mean of the
    ranks' losses is the global batch's."""
    results = _run("cross", prescaled)
    if not prescaled:
        mean = torch.tensor([results[0]["losses"], results[1]["losses"]]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(_reference("cross", GLOBAL_BATCH)[0]),
                                   **TOL)
    for res in results:
        assert res["bad"] == [] and res["replicated"] == ()
        assert res["widths"] == [VOCAB // 2] * 2 * STEPS  # fused: 2 microbatches a step
        assert res["local"]["lm.transformer.seq_layers.1.crossattention.key.weight"] == (8, 16)
        assert res["local"]["lm.word_embedding.weight"] == (VOCAB // 2, 16)
        assert len(res["sharded"]) == 36  # 22 + 2 x (q, k, v: weight + bias; dense)
