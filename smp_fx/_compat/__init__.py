"""Compatibility shims: ``shims/`` holds a top-level ``smdistributed`` package that
``smp-fx run`` puts on its children's ``PYTHONPATH`` (and nowhere else), so SageMaker
scripts import smp-fx under their usual names."""

from __future__ import annotations

from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shims"
