"""GPT-2 with ``use_cache`` at its default (transformers' ``True``) at pp 2 on 2 processes
trains equal to one process: its key/value caches, made on the first stage, pass through
the last as outputs without a gradient. transformers 4.x returns them as tuples of tensors
(``make test-transformers4`` runs this file); 5.x returns a ``DynamicCache`` object, which
the tracer refuses (docs/limitations.md). 3 Adam steps, every gradient after every step and
the full ``state_dict()`` after them within 1e-5 of the plain model on the global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) >= 5,
    reason="transformers 5 returns the cache as a DynamicCache, which the tracer refuses")

BATCH, STEPS, VOCAB = 4, 3, 128


def _model() -> Any:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    assert config.use_cache
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, 16), generator=g) for _ in range(STEPS)]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def _loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                             ids[:, 1:].flatten())


def _reference(path: Path) -> None:
    model = _model()
    opt = _adam(model.parameters())
    grads = []
    for ids in _batches():
        opt.zero_grad()
        out = model(input_ids=ids)
        assert out.past_key_values is not None
        _loss(out, ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    torch.save((grads, model.state_dict()), path)


def _body(path: str) -> list[str]:
    import smp_fx as smp

    dist.init_process_group("gloo")
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "interleaved"})
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(_adam(model.parameters()))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> Any:
        loss = _loss(model(input_ids=ids), ids)
        model.backward(loss)
        return loss

    ref_grads, ref_state = torch.load(path, weights_only=True)
    bad: list[str] = []
    for step, ids in enumerate(_batches()):
        opt.zero_grad()
        train_step(model, ids)
        grads = {n: p.grad for n, p in model.local_named_parameters()}
        bad += [f"grad {n} step {step}"
                for n in mismatched(grads, ref_grads[step], atol=1e-5, rtol=1e-5)]
        opt.step()
    bad += [f"state_dict {n}"
            for n in mismatched(model.state_dict(), ref_state, atol=1e-5, rtol=1e-5)]
    return bad


@pytest.mark.multiproc
def test_gpt2_with_its_cache_trains_at_pp2_equal_to_one_process(tmp_path: Path) -> None:
    path = tmp_path / "reference.pt"
    _reference(path)
    assert run_ranks(_body, 2, str(path), timeout=300) == [[], []]
