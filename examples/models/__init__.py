"""Example models: each file has ``build_model()`` and ``example_inputs(batch_size) -> tuple``
(positional args), plus ``example_targets`` and ``loss_fn`` for training. The CLI loads them
by path; ``load(name)`` is a convenience for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from smp_fx.cli.partition import load_model_file

NAMES: tuple[str, ...] = ("mlp", "cnn", "gpt", "hf_gpt2", "hf_bert")


def load(name: str) -> ModuleType:
    """Import ``examples/models/<name>.py`` by path (``examples`` is not an installed package).

    A thin wrapper: the CLI's ``load_model_file`` is the one loader of model files (it
    registers the module in ``sys.modules`` before running it, which dataclasses need), so
    ``smp-fx partition examples/models/gpt.py`` and ``load("gpt")`` import alike.
    """
    return load_model_file(str(Path(__file__).with_name(f"{name}.py")))
