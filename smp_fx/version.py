"""Which SMP smp-fx follows: a constant of its own, so checkpoints and the shims read it
without importing the rest of either."""

from __future__ import annotations

SMP_API_VERSION = "1.15.0"
"""The SMP release whose PyTorch surface smp-fx follows, the last of v1:
``smdistributed.modelparallel.__version__`` under ``smp-fx run``, which clients compare
against (the Hugging Face Trainer needs >= 1.10, which introduced ``save_checkpoint`` /
``resume_from_checkpoint`` and ``state.module_manager.translate_functions``; 1.11-1.15
added the configuration of docs/parameters.md's last rows and ``smp.model_creation``)."""
