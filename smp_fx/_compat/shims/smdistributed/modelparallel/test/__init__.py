"""Shim: ``smdistributed.modelparallel.test``, SMP's own test helpers (see ``torch.utils``)."""
