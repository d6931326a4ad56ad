"""Shim of SageMaker's ``smdistributed`` namespace, backed by smp-fx (``smp-fx run`` only)."""
