"""Compatibility shims: the ``smdistributed`` package ``smp-fx run`` puts on its children's
``PYTHONPATH``, and the post-import hooks the Trainer's SMP mode needs (``hf_trainer``).
"""

from __future__ import annotations

from pathlib import Path

from smp_fx.version import SMP_API_VERSION

SHIM_DIR = Path(__file__).resolve().parent / "shims"

__all__ = ["SHIM_DIR", "SMP_API_VERSION"]
