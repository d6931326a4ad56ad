"""Shim: ``smdistributed.modelparallel.test.torch`` (see ``utils``)."""
