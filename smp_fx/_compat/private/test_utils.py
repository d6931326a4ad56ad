"""``smdistributed.modelparallel.test.torch.utils``: SMP's own test helpers.

AWS's BERT pretraining script imports ``dump_model`` and ``verify`` from it inside its
training loop and never calls them. SMP never documented what they do, so smp-fx does not
guess: the import works, and a call stops with the script-side fix.
"""

from __future__ import annotations

from typing import Any, NoReturn

from cost_model.errors import not_implemented


def _refuse(name: str) -> NoReturn:
    raise not_implemented(
        f"SMP's internal test helper {name} (undocumented)",
        f"smdistributed.modelparallel.test.torch.utils.{name}",
        "compare the model's state_dict() with torch.testing.assert_close in the script")


def dump_model(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused when called (see the module docstring)."""
    _refuse("dump_model")


def verify(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused when called (see the module docstring)."""
    _refuse("verify")


__all__ = ["dump_model", "verify"]
