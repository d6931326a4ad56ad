"""Checkpoints across tensor-parallel degrees (``smp_fx.ckpt.tp_shards``), on 2 gloo ranks.

One spawn runs every case in the same two processes (``smp.reset`` between them), both
ranks on the same batch (tp=2: ``prescaled_batch``; tp=1: two replicas with ddp), Adam:

* tp=2 -> tp=1: 2 steps at tp=2, ``smp.save_checkpoint`` (partial: each (pp, tp) rank's
  shards and their descriptions; and full), 2 more steps; then a fresh model at tp=1
  resumes from the partial checkpoint and takes the 2 steps: the same parameters as the
  uninterrupted run (model and Adam state re-cut from the shards);
* tp=1 -> tp=2: the same the other way;
* both again with a tied embedding / LM head of 7 rows, padded to 8 at tp=2 (the files
  hold the padded shards, joined without the padding and re-padded when cut);
* the full checkpoint saved at tp=2 loads strictly into the plain ``nn.Module``;
* a partial state of the other tp rank handed to ``load_state_dict`` is refused by name.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks

BATCH, STEPS = 8, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import smp_fx as smp

        self.inp = nn.Linear(8, 16)
        with smp.tensor_parallelism():
            self.fc1 = nn.Linear(16, 32)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.fc2(self.act(self.fc1(h))))


class TiedVocab(nn.Module):
    """A vocabulary of 7 (not divisible by tp=2: padded to 8 rows, 4 per rank) in a
    vocab-parallel embedding with its tied LM head, around a replicated linear."""

    VOCAB = 7

    def __init__(self) -> None:
        super().__init__()
        import smp_fx as smp

        self.wte = nn.Embedding(self.VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, self.VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        smp.set_tensor_parallelism(self.wte)
        smp.set_tensor_parallelism(self.lm_head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mix(self.wte(ids)))).flatten(0, 1)


MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "vocab": TiedVocab}


def _batches(kind: str = "mlp") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    if kind == "vocab":
        return [(torch.randint(0, 7, (BATCH, 3), generator=g),
                 torch.randint(0, 7, (BATCH * 3,), generator=g)) for _ in range(STEPS)]
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)]


class Run:
    """A DistributedModel + optimizer at one tp degree, trained on ``_batches()``."""

    def __init__(self, tp: int, seed: int, kind: str = "mlp") -> None:
        import smp_fx as smp
        from smp_fx.world import state

        state._reset()
        smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": tp, "ddp": True,
                  "prescaled_batch": True, "microbatches": 1})
        torch.manual_seed(seed)
        self.kind = kind
        self.model = smp.DistributedModel(MODELS[kind]())
        self.opt = smp.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=1e-2))

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            return loss

        self.train_step = train_step

    def step(self, i: int) -> None:
        x, y = _batches(self.kind)[i]
        self.opt.zero_grad()
        self.train_step(self.model, x, y)
        self.opt.step()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def _case(path: str, saved_tp: int, loaded_tp: int, kind: str = "mlp") -> list[str]:
    import smp_fx as smp

    run = Run(saved_tp, seed=0, kind=kind)
    tp_rank = smp.tp_rank()  # the model's, also after the next Run's smp.init
    run.step(0)
    run.step(1)
    smp.save_checkpoint(path, f"tp{saved_tp}", model=run.model, optimizer=run.opt)
    if saved_tp == 2:
        smp.save_checkpoint(path, "full", partial=False, model=run.model)
        at_save = run.params()
    run.step(2)
    run.step(3)
    want = run.params()
    resumed = Run(loaded_tp, seed=1, kind=kind)  # other weights: all must come from the checkpoint
    smp.resume_from_checkpoint(path, tag=f"tp{saved_tp}")
    resumed.step(2)
    resumed.step(3)
    bad = [f"{kind} tp{saved_tp}->tp{loaded_tp} {n}"
           for n in mismatched(resumed.params(), want, atol=1e-5, rtol=1e-5)]
    if saved_tp == 2 and dist.get_rank() == 0:
        plain = MODELS[kind]()
        sd = torch.load(os.path.join(path, "full"), weights_only=True)
        plain.load_state_dict(sd, strict=True)
        bad += [f"{kind} full {n}" for n in mismatched(plain.state_dict(), at_save, atol=0,
                                                         rtol=0)]
    if kind == "vocab" and saved_tp == 2:  # the partial state holds padded shards
        local = run.model.local_state_dict()
        if tuple(local["wte.weight"].shape) != (4, 8) or local["_smp_tp_shards"][
                "wte.weight"] != [0, 2, tp_rank, 1, 1]:
            bad.append(f"vocab partial {local['_smp_tp_shards']}")
    return bad


def _foreign_refused() -> bool:
    """Rank 1's shards offered to rank 0 (same degree, other index): refused, by name."""
    import smp_fx as smp

    run = Run(2, seed=0)
    run.step(0)
    mine = run.model.local_state_dict()
    theirs = [None, None]
    dist.all_gather_object(theirs, mine)
    other = theirs[1 - dist.get_rank()]
    try:
        run.model.load_state_dict(other, same_partition_load=True)
    except smp.SMPError as exc:
        return "shards of another rank" in str(exc) and "fc1.weight" in str(exc)
    return False


def _body(tmp: str) -> dict[str, Any]:
    dist.init_process_group("gloo")  # one default group; each case's smp.init adds its own
    bad = _case(os.path.join(tmp, "a"), 2, 1) + _case(os.path.join(tmp, "b"), 1, 2)
    bad += _case(os.path.join(tmp, "c"), 2, 1, "vocab") + _case(os.path.join(tmp, "d"), 1, 2,
                                                                "vocab")
    return {"bad": bad, "foreign_refused": _foreign_refused()}


@pytest.mark.multiproc
def test_checkpoints_reshard_across_tensor_parallel_degrees(tmp_path: Any) -> None:
    results = run_ranks(_body, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        assert r["foreign_refused"], f"rank {rank}"
