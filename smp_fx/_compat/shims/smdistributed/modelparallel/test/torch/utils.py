"""Shim: ``smdistributed.modelparallel.test.torch.utils`` is
``smp_fx._compat.private.test_utils`` (one module object)."""

from __future__ import annotations

import sys

from smp_fx._compat.private import test_utils

sys.modules[__name__] = test_utils
