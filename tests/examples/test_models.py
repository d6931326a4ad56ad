"""Every example model follows the convention the CLI, runtime and benchmarks rely on."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import EXPECTED_FRONTEND, example


@pytest.mark.parametrize("name", sorted(EXPECTED_FRONTEND))
def test_convention_and_one_training_step(name: str) -> None:
    ex = example(name)
    model = ex.build_model()
    args = ex.example_inputs(3)
    assert isinstance(args, tuple) and all(a.shape[0] == 3 for a in args)
    target = ex.example_targets(3)
    loss = ex.loss_fn(model(*args), target)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)


def test_deterministic_and_gpt_overrides() -> None:
    for name in ("hf_gpt2", "hf_bert"):  # dropout 0: two runs agree exactly
        model = example(name).build_model()
        args = example(name).example_inputs(2)
        torch.testing.assert_close(model(*args), model(*args), rtol=0, atol=0)
    big = example("gpt").build_model(n_layer=3, n_embd=48, n_head=6)
    assert len(big.h) == 3 and big.wte.weight.shape == (128, 48)
    assert big.lm_head.weight is big.wte.weight


def test_load_registers_the_module_and_matches_the_cli_loader() -> None:
    """A module run before it is in sys.modules breaks @dataclass (gpt.GPTConfig)."""
    import dataclasses
    import sys

    from examples.models import load
    from smp_fx.cli.partition import load_model_file

    gpt = load("gpt")
    assert sys.modules[gpt.__name__] is gpt
    assert dataclasses.is_dataclass(gpt.GPTConfig)
    again = load_model_file(gpt.__file__)
    assert again.__name__ == gpt.__name__ and dataclasses.is_dataclass(again.GPTConfig)
