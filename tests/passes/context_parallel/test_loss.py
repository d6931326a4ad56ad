"""A loss inside the model under context parallelism, in one process (``loss``).

The rewrite of a tiny attention model whose forward computes a cross-entropy from labels
it shifts itself, as Hugging Face does (padded with -100, then the next token's; or, as
transformers 4.x does, the logits' last position sliced off, which the rewrite turns into
the padded labels): the loss becomes ``cp_loss``, the labels are not split at the input
but shifted whole and cut to the local rows at the loss, nothing is gathered.
``loss_parts`` over each cp rank's tokens, summed, gives one process's loss (ignored
targets, class weights, label smoothing); ranks over real groups:
tests/smp_fx/parallel/test_context_parallel_hf.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cost_model.errors import SMPPassError
from passes.context_parallel import context_parallel
from passes.context_parallel.collectives import local_index
from passes.context_parallel.loss import loss_parts
from passes.trace import trace
from tests.passes.context_parallel.test_rewrite import SEQ, Tiny

VOCAB = 32


class WithLoss(nn.Module):
    """``Tiny`` and Hugging Face's causal-LM loss of its logits (labels shifted inside):
    transformers 5's (the labels padded, then shifted) or 4.x's (``sliced``: the logits'
    last position and the labels' first sliced off)."""

    def __init__(self, reduction: str = "mean", sliced: bool = False) -> None:
        super().__init__()
        self.tiny, self.reduction, self.sliced = Tiny("sdpa"), reduction, sliced

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.tiny(ids)
        if self.sliced:
            logits = logits[..., :-1, :].contiguous()
            shifted = labels[..., 1:].contiguous()
        else:
            shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, VOCAB), shifted.view(-1),
                               reduction=self.reduction)


def _traced(reduction: str = "mean", sliced: bool = False
            ) -> tuple[nn.Module, torch.fx.GraphModule, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = WithLoss(reduction, sliced)
    ids, labels = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    labels[1, 3:9] = -100
    return model, trace(model, (ids, labels), {}, "export"), (ids, labels)


@pytest.mark.parametrize("sliced", [False, True])
def test_a_loss_inside_the_model_is_reduced_over_cp_and_its_labels_shifted_whole(
        sliced: bool) -> None:
    model, gm, inputs = _traced(sliced=sliced)
    new, plan = context_parallel(gm, 2)
    assert len(plan.losses) == 1 and plan.gathered == () and len(plan.split) == 1
    assert "losses reduced over cp" in plan.text()
    slices = [n for n in new.graph.nodes if n.target is torch.ops.aten.slice.Tensor
              and n.args[1:4] == (1, 0, -1)]
    assert not slices  # 4.x's slice of the logits is gone: the labels are padded instead
    torch.testing.assert_close(new(*inputs), model(*inputs))


def test_a_per_token_loss_of_a_chunk_is_refused() -> None:
    _, gm, _ = _traced("none")
    with pytest.raises(SMPPassError, match="per-token loss.*reduce it") as err:
        context_parallel(gm, 2)
    assert "\n" not in str(err.value)


def test_local_outputs_are_not_gathered() -> None:
    gm = trace(Tiny("sdpa"), (torch.randint(0, VOCAB, (2, SEQ)),), {}, "export")
    _, plan = context_parallel(gm, 2, local_outputs=True)
    assert plan.gathered == () and len(plan.local_outputs) == 1
    assert "outputs left local" in plan.text()


@pytest.mark.parametrize("options", [{}, {"weight": torch.rand(VOCAB) + 0.5},
                                     {"label_smoothing": 0.1}])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_ranks_parts_make_one_process_loss(options: dict[str, object], cp: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, SEQ, VOCAB)
    labels = torch.randint(0, VOCAB, (2, SEQ))
    labels[0, :SEQ // 2 + 1] = -100  # the ranks count different numbers of targets
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    whole = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), **options)  # type: ignore[arg-type]
    weight = options.get("weight")
    rest = (options["label_smoothing"],) if "label_smoothing" in options else ()
    parts = [loss_parts(torch.ops.aten.cross_entropy_loss.default,
                        logits[:, mine].flatten(0, 1), shifted[:, mine].flatten(),
                        weight, 1, -100, *rest)
             for mine in (local_index(SEQ, cp, r) for r in range(cp))]
    total, count = (sum(p[i] for p in parts) for i in (0, 1))
    torch.testing.assert_close(total / count, whole)
