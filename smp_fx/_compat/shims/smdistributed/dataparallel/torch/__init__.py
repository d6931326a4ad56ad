"""Shim: ``smdistributed.dataparallel.torch`` (``torch_smddp``, ``distributed``, ``parallel``)."""
