"""Delayed initialisation through ``smp.DistributedModel`` on real ranks: the model built
on meta and materialised at partitioning equals the eager build with the same seed bitwise,
every parameter (gathered from its sdp or tp shards, or from the other pipeline stage) and
every buffer, persistent or not (rotary frequencies, position ids).

At sharded data parallelism 2 (as at tensor parallelism 2 without a pipeline) a rank
materialises the whole model before tracing, then shards it; at pp 2 x tp 2 each rank
materialises only its stage's shards, cut on meta by the rewrite, as slices of the eager
weights (one full weight at a time).
Each architecture is traced and planned once per layout (about 2 s each unloaded), so the
sdp grid is a representative subset of ``examples/models/hf_zoo.py``: the notebooks'
families (GPT-NeoX, Falcon, T5), tied embeddings (GPT-2), a tied bias and computed buffers
(BERT), experts (Mixtral); every zoo architecture's materialisation itself is checked per
pipeline half in ``test_delayed_init.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks

pytest.importorskip("transformers")

SDP = ("gpt_neox", "falcon", "t5", "gpt2", "bert", "mixtral")
CUT = ("gpt2", "llama")


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in
            [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]}


def _wrong(name: str) -> list[str]:
    """Names of ``name``'s tensors that differ from the eager build once the delayed build
    is materialised by the current configuration's ``DistributedModel`` (one forward)."""
    import smp_fx as smp
    from examples.models import hf_zoo

    smp.reset()
    built = hf_zoo.build(name, marked=False)
    eager, persistent = _tensors(built), set(built.state_dict())
    with smp.delay_param_initialization():
        net = hf_zoo.build(name, marked=smp.tp_size() > 1)
    model = smp.DistributedModel(net)

    @smp.step
    def forward(model: Any, *xs: torch.Tensor) -> Any:
        return model(*xs)

    forward(model, *hf_zoo.inputs(name))
    full = {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
            for n, v in model.state_dict().items()}
    # the buffers this rank holds: its stages' and, materialised in place, the module's
    held = [*model.local_named_buffers(), *net.named_buffers(remove_duplicate=False)]
    buffers = {n: b for n, b in held if n in eager and not b.is_meta}
    return [f"{name}: {n}" for n in mismatched({**full, **buffers}, eager)] + \
        [f"{name}: {n} missing" for n in sorted(persistent - set(full))]


def _layouts(layouts: list[tuple[dict[str, Any], tuple[str, ...]]]) -> list[str]:
    import smp_fx as smp

    wrong: list[str] = []
    for config, names in layouts:
        smp.init({"pipeline_parallel_degree": 1, "ddp": True, **config})
        wrong += [w for name in names for w in _wrong(name)]
    return wrong


@pytest.mark.multiproc
def test_sdp2_materialises_as_the_eager_build() -> None:
    layouts = [({"sharded_data_parallel_degree": 2}, SDP)]
    assert run_ranks(_layouts, 2, layouts, timeout=600) == [[], []]


@pytest.mark.multiproc
def test_pp2_tp2_shards_materialise_as_slices_of_the_eager_build() -> None:
    layouts = [({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                 "microbatches": 1}, CUT)]
    assert run_ranks(_layouts, 4, layouts, timeout=600) == [[]] * 4
