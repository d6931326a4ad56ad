"""Saving and loading: files, state-dict merging by name, and the state-dict methods.

Named ``ckpt``: a subpackage ``checkpoint`` would shadow SMP's ``smp.checkpoint`` function.
"""
