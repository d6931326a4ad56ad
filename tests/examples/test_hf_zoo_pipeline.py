"""Hugging Face models of ``examples/models/hf_zoo.py`` at pp 2 (both stages in this
process) equal one process. transformers 4.46 (``make test-transformers4``) runs every
architecture it has: its modelling code writes in place where 5.x does not (Mixtral's
routing ``index_add_`` into one tensor per expert, Bloom's causal mask, DeBERTa-v2's
``XSoftmax`` into the softmax output autograd saved: ``passes.in_place``,
``passes.fresh_writes``). Under 5.x, where Llama, T5, GPT-2 and BERT run at pp 2 across
processes (``tests/smp_fx/test_schedules_hf.py``), only Mixtral and Bloom run here. One SGD step at
learning rate 1, so the parameters after it compare the gradients at 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import smp_fx as smp
from tests.helpers import zoo
from tests.helpers.numerics import init

transformers = pytest.importorskip("transformers")
pytest.importorskip("passes.in_place", reason="in-place writes kept on one stage")
hf_zoo = pytest.importorskip("examples.models.hf_zoo")

ARCHS = tuple(hf_zoo.ARCHITECTURES) if transformers.__version__.startswith("4.") \
    else ("mixtral", "bloom")
BATCH, STEPS, LR = 2, 1, 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_pp2_equals_one_process(arch: str, one_thread: None) -> None:
    if not hasattr(transformers, hf_zoo.ARCHITECTURES[arch].model):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    _, want = zoo.sgd_reference(arch, BATCH, STEPS, LR)
    init(2, 2, "interleaved")
    net = hf_zoo.build(arch, marked=False)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train(model: Any, y: torch.Tensor, *x: torch.Tensor) -> Any:
        loss = hf_zoo.loss_fn(model(*x), y)
        model.backward(loss)
        return loss

    for x, y in zoo.batches(arch, BATCH, STEPS):
        optimizer.zero_grad()
        train(model, y, *x)
        optimizer.step()
    got = net.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)
