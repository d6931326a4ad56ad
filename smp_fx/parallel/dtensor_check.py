"""Whether a value is a ``DTensor``, without importing ``torch.distributed.tensor`` (with
sympy about a second of every process that imports smp_fx): no ``DTensor`` exists before
that module is loaded, so an unloaded module answers no.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """``isinstance(value, DTensor)``, the module imported only if someone else did."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


__all__ = ["is_dtensor"]
