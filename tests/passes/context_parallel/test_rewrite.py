"""The context-parallel rewrite on small exported models, in one process (no group bound:
every cp op is the identity, so a rewritten graph must compute the original function).

Tiny attention models: SDPA (causal, with learned positions that stay whole), attention
written as matmul-softmax-matmul, and a sequence reduction inside the model; the balanced
chunking; the length check. The numerics over real cp groups are
tests/smp_fx/parallel/test_context_parallel_hf.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cost_model.errors import SMPPassError, SMPRuntimeError
from passes import meta
from passes.context_parallel import ContextParallelPlan, collectives, context_parallel
from passes.context_parallel.collectives import local_index
from passes.trace import trace

SEQ, HIDDEN = 16, 8


class Tiny(nn.Module):
    """Embedding + learned positions, one attention, a head; ``kind`` picks the attention
    form ("sdpa", "eager", "gqa": two query heads reading one key/value head repeated as
    Hugging Face repeats it), a per-sequence mean after it ("mean"), or positions numbered
    from the tokens by a cumulative sum ("numbered")."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(32, HIDDEN)
        self.pos = nn.Embedding(64, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = nn.Linear(HIDDEN, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        if self.kind == "numbered":  # RoBERTa's: the non-padding tokens numbered from 1
            kept = ids.ne(0).int()
            positions = torch.cumsum(kept, dim=1) * kept
        h = self.emb(ids) + self.pos(positions)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        if self.kind == "gqa":
            b, s, d = ids.shape[0], ids.shape[1], HIDDEN // 2
            q = q.view(b, s, 2, d).transpose(1, 2)
            k, v = (t[..., :d].view(b, s, 1, d).transpose(1, 2)[:, :, None]
                    .expand(b, 1, 2, s, d).reshape(b, 2, s, d) for t in (k, v))
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h.transpose(1, 2).reshape(b, s, HIDDEN)
        elif self.kind == "eager":
            scores = (q @ k.transpose(-1, -2)) / HIDDEN ** 0.5
            h = scores.softmax(-1) @ v
        else:
            h = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                               is_causal=True)[:, 0]
        if self.kind == "mean":
            h = h - h.mean(dim=1, keepdim=True)
        out: torch.Tensor = self.head(h)
        return out


def _traced(kind: str, seq: int = SEQ) -> tuple[nn.Module, torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Tiny(kind)
    ids = torch.randint(0, 32, (2, seq))
    return model, trace(model, (ids,), {}, "export"), ids


def test_sdpa_is_rewritten_and_positions_stay_whole() -> None:
    model, gm, ids = _traced("sdpa")
    new, plan = context_parallel(gm, 2)
    assert len(plan.attention) == 1 and len(plan.split) == 1 and len(plan.gathered) == 1
    assert plan.localized  # the whole positions' embedding meets the local tokens
    assert "1 attention gathering keys and values" in plan.text()
    assert ContextParallelPlan.from_json(plan.to_json()) == plan
    torch.testing.assert_close(new(ids), model(ids))
    assert context_parallel(gm, 1)[1] == ContextParallelPlan(1)


def test_a_cut_to_the_local_rows_is_described_as_local() -> None:
    """A whole value cut to the local tokens (``cp_localize``) has the local length: a
    pipeline stage receiving it checks its shape against that, not the whole length (a
    cut right after it had the receiving ranks refuse the sender's shape)."""
    _, gm, _ = _traced("sdpa")
    new, plan = context_parallel(gm, 2)
    cuts = [n for n in new.graph.nodes if n.target is collectives.cp_localize]
    assert cuts and plan.localized
    assert all(meta.CP_LOCAL.get(n) == (1,) for n in cuts), [n.meta for n in cuts]


def test_positions_numbered_from_the_tokens_read_the_whole_input() -> None:
    """RoBERTa's positions: a ``cumsum`` over the ids, which on a chunk would restart at
    each rank's first token. That reader keeps the whole ids; the embedding's reads the
    split; the positions meet the local tokens cut to their rows."""
    model, gm, ids = _traced("numbered")
    ids[1, 10:] = 0  # a padded tail: its positions stay 0
    new, plan = context_parallel(gm, 2)
    assert len(plan.split) == 1 and len(plan.attention) == 1 and plan.localized
    torch.testing.assert_close(new(ids), model(ids))


def test_grouped_query_keys_and_values_are_gathered_before_their_repeat() -> None:
    model, gm, ids = _traced("gqa")
    new, plan = context_parallel(gm, 2)
    assert len(plan.small_kv) == 2 and len(plan.attention) == 1
    torch.testing.assert_close(new(ids), model(ids))


@pytest.mark.parametrize("kind, reason", [("eager", "matmul: holds sequence x sequence"),
                                          ("mean", "along the sequence of a chunk")])
def test_what_would_be_wrong_on_a_chunk_is_refused_with_node_and_reason(kind: str,
                                                                        reason: str) -> None:
    _, gm, _ = _traced(kind)
    with pytest.raises(SMPPassError, match=reason) as err:
        context_parallel(gm, 2)
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)


def test_chunks_are_balanced_for_causal_attention() -> None:
    assert local_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    work = [int((local_index(64, 4, r) + 1).sum()) for r in range(4)]  # keys each query reads
    assert len(set(work)) == 1
    assert sorted(torch.cat([local_index(24, 3, r) for r in range(3)]).tolist()) == \
        list(range(24))


def test_a_length_cp_cannot_split_names_the_multiple_to_pad_to() -> None:
    with pytest.raises(SMPRuntimeError, match="multiple of 4.*pad the sequences") as err:
        local_index(18, 2, 0)
    assert "\n" not in str(err.value)
