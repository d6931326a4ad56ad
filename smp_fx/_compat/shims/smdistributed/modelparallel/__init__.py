"""Shim: ``smdistributed.modelparallel``; see its ``torch`` submodule."""
