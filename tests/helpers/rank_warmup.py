"""Imported once by the forkserver of ``tests.helpers.dist.run_ranks``: this CPU's quick
device spec (the built-in "cpu" spec planning uses without ``SMP_FX_DEVICE_SPEC``) measured
there with one intra-op thread, as a rank measures it, so the ranks forked from the server
inherit it (``quick_cpu_spec`` caches it per process) and rank 0 of each spawn does not
measure it again (0.5 CPU s a spawn). It also imports every public name of ``smp_fx`` (the
package loads them on first use), so no rank imports them again."""

from __future__ import annotations

import torch

import smp_fx
from cost_model.calibrate import quick_cpu_spec

torch.set_num_threads(1)
quick_cpu_spec()
for _name in smp_fx.__all__:
    getattr(smp_fx, _name)
