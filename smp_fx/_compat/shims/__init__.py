"""Directory put on PYTHONPATH by ``smp-fx run``; its ``smdistributed`` package is the shim."""
