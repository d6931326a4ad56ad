"""``smp.nn.huggingface``: SMP's distributed versions of Hugging Face models and the
functions that translate their state dicts.

Importing registers the replacements; nothing of transformers is imported until a model
is replaced.
"""

from __future__ import annotations

from smp_fx.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox, roberta

__all__ = ["bert", "gpt2", "gptj", "gptneo", "gptneox", "roberta"]
