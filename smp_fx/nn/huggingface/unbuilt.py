"""SMP's Hugging Face translate and hook functions whose distributed model smp-fx has not
built: importable by their names (AWS's GPT-J and GPT-Neo scripts import them at the top,
and call them only on paths that use SMP's replacement), refused when called.

SMP replaced GPT-J and GPT-Neo by its ``DistributedTransformerLMHead`` with rotary
embeddings, GPT-J's parallel attention and MLP and GPT-Neo's local attention, which
``smp.nn``'s transformer does not have (``registry``'s docstring). A state dict in SMP's
layout of those models has no module here to load into, so translating to or from it
would produce names nothing reads. What does run: the Hugging Face model itself, wrapped
as it is (``smp.DistributedModel`` keeps its names, so its checkpoints need no
translation), and at ``tensor_parallel_degree > 1`` smp-fx's own tensor-parallel rewrite
of the marked model. ``refusing(name, family)`` makes the function that says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from cost_model.errors import not_implemented


def refusing(name: str, family: str, module: str,
             fix: str | None = None) -> Callable[..., NoReturn]:
    """SMP's ``smp.nn.huggingface.<module>.<name>``, raising when called (with ``fix``, or
    the module docstring's)."""

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise not_implemented(
            f"SMP's distributed {family} (not built in smp-fx), so its state-dict layout "
            "does not exist here",
            f"smp.nn.huggingface.{module}.{name}",
            fix or (f"use the Hugging Face {family} model as it is (no "
                    "use_distributed_transformer): smp.DistributedModel keeps its parameter "
                    "names, so its checkpoints load in Hugging Face without translation"))

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"SMP's {name} for {family}: refused when called (module docstring)."
    return refused


__all__ = ["refusing"]
