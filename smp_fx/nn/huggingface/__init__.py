"""``smp.nn.huggingface``: SMP's distributed versions of Hugging Face models and the
functions that translate their state dicts (``smp.nn.huggingface.gpt2``).

Importing this package registers the replacements (``registry``); nothing of transformers
is imported until a model is replaced.
"""

from __future__ import annotations

from smp_fx.nn.huggingface import gpt2

__all__ = ["gpt2"]
