"""Compatibility shims: ``shims/`` holds a top-level ``smdistributed`` package that
``smp-fx run`` puts on its children's ``PYTHONPATH`` (and nowhere else; other launchers set
``PYTHONPATH`` to ``SHIM_DIR`` themselves), so SageMaker scripts import smp-fx under their
usual names, and a ``sitecustomize`` that registers the post-import hooks with which the
Hugging Face Trainer's SMP mode runs as SMP ran it (``hf_trainer``)."""

from __future__ import annotations

from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shims"

SMP_API_VERSION = "1.15.0"
"""The SMP release whose PyTorch surface smp-fx follows, the last of v1:
``smdistributed.modelparallel.__version__`` under ``smp-fx run``, which clients compare
against (the Hugging Face Trainer needs >= 1.10, which introduced ``save_checkpoint`` /
``resume_from_checkpoint`` and ``state.module_manager.translate_functions``; 1.11-1.15
added the configuration of docs/parameters.md's last rows and ``smp.model_creation``)."""
