"""Compatibility shims: ``shims/`` holds a top-level ``smdistributed`` package that
``smp-fx run`` puts on its children's ``PYTHONPATH`` (and nowhere else; other launchers set
``PYTHONPATH`` to ``SHIM_DIR`` themselves), so SageMaker scripts import smp-fx under their
usual names, and a ``sitecustomize`` that registers the post-import hooks with which the
Hugging Face Trainer's SMP mode runs as SMP ran it (``hf_trainer``)."""

from __future__ import annotations

from pathlib import Path

from smp_fx.version import SMP_API_VERSION

SHIM_DIR = Path(__file__).resolve().parent / "shims"

__all__ = ["SHIM_DIR", "SMP_API_VERSION"]
