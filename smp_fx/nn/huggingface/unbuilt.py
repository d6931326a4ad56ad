"""Refused when called: SMP's per-layer hook functions for ``smp.tp_register_with_module``,
whose per-block replacement is not built; the message names what runs instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from cost_model.errors import not_implemented


def refusing(name: str, family: str, module: str, fix: str) -> Callable[..., NoReturn]:
    """SMP's ``smp.nn.huggingface.<module>.<name>``, raising ``fix`` when called."""

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise not_implemented(f"SMP's per-layer replacement of a {family} (not built in "
                              "smp-fx)", f"smp.nn.huggingface.{module}.{name}", fix)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"SMP's {name} for {family}: refused when called (module docstring)."
    return refused


def layer_hooks(name: str, family: str, block: str, model: str,
                module: str) -> Callable[..., NoReturn]:
    """SMP's ``get_hf_<family>_..._hooks`` for ``smp.tp_register_with_module``: refused,
    naming the paths that are built."""
    return refusing(name, f"{family} block ({block} -> DistributedTransformerLayer)", module,
                    f"create the {model} inside smp.model_creation(tensor_parallelism=True) "
                    "(the whole model is replaced), or mark its blocks with "
                    "smp.tensor_parallelism() for smp-fx's own tensor-parallel rewrite")


__all__ = ["layer_hooks", "refusing"]
