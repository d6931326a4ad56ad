"""Shim: ``smdistributed.dataparallel``; see its ``torch`` submodule."""
