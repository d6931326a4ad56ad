"""The ``smdistributed`` import names for the duration of a block, as under ``smp-fx run``.

The shim directory goes on ``sys.path`` and comes off again, and every ``smdistributed``
module imported meanwhile is dropped from ``sys.modules``, so the next test starts
without them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from smp_fx._compat import SHIM_DIR


@contextlib.contextmanager
def shims() -> Iterator[None]:
    before = set(sys.modules)
    sys.path.insert(0, str(SHIM_DIR))
    try:
        yield
    finally:
        sys.path.remove(str(SHIM_DIR))
        for name in set(sys.modules) - before:
            if name.startswith("smdistributed"):
                del sys.modules[name]
