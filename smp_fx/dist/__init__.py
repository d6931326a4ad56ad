"""Processes and groups: launch detection, the rank topology, the process-wide state after
``smp.init``, collectives on SMP's groups, the ``smddp`` backend and data parallelism."""
