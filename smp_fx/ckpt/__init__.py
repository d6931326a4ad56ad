"""Saving and loading: ``smp.save`` / ``smp.load`` files, pure state-dict merging and
splitting by parameter name, and the state-dict methods of the model and optimizer.

(Named ``ckpt`` rather than ``checkpoint``: ``smp.checkpoint`` is SMP's activation
checkpointing function, and a subpackage of that name would shadow it on import.)"""
