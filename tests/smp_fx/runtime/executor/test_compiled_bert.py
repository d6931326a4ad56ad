"""Compiled stages equal one process on Hugging Face BERT (``BertForMaskedLM`` from a tiny
config, ``examples/models/hf_zoo.py``): pp 2 on 2 gloo processes under 1F1B, interleaved
v = 2 and ZB-V, compiled with ``aot_eager``: the loss of every step, every gradient after
every step and the ``state_dict()`` after 3 Adam steps within 1e-5 of the plain model
trained in one process; every stage compiled (whole, or under ZB-V in regions between its
eager GEMMs), none falling back, none recompiling (``test_compiled``'s checks).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_ranks
from tests.helpers.reference import train_plain
from tests.smp_fx.runtime.executor.test_compiled import _adam, _batch_loss, _batches, _case, _model

# (pipeline, virtual_pipeline_degree)
SCHEDULES = (("interleaved", 1), ("interleaved", 2), ("zbv", 2))


def _references(path: Path) -> None:
    model = _model("bert")
    run = train_plain(model, _adam(model.parameters()), _batches("bert"),
                      functools.partial(_batch_loss, "bert"))
    torch.save((run.losses, [{n: g for n, g in s.items() if g is not None} for s in run.grads],
                run.state), path)


def _all_cases(path: str) -> list[str]:
    from smp_fx.world import state

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ref = torch.load(path, weights_only=True)
    try:
        return [b for pipeline, v in SCHEDULES
                for b in _case("bert", pipeline, v, "aot_eager", ref)]
    finally:
        state._reset()


@pytest.mark.multiproc
def test_compiled_bert_equals_one_process(tmp_path: Path) -> None:
    path = tmp_path / "references.pt"
    _references(path)
    assert run_ranks(_all_cases, 2, str(path), timeout=600) == [[], []]
