"""Example models: each file has ``build_model()`` and ``example_inputs(batch_size) -> tuple``
(positional args), plus ``example_targets`` and ``loss_fn`` for training. The CLI loads them
by path; ``load(name)`` is a convenience for tests and benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAMES: tuple[str, ...] = ("mlp", "cnn", "gpt", "hf_gpt2", "hf_bert")


def load(name: str) -> ModuleType:
    """Import ``examples/models/<name>.py`` by path (``examples`` is not an installed package)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"smp_fx_example_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load example model {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
