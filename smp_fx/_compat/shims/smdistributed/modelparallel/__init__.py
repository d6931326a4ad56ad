"""Shim: ``smdistributed.modelparallel``; see its ``torch`` submodule.

``__version__`` is the SMP version whose API smp-fx implements (not smp-fx's own version),
since that is what scripts and libraries check before using an API.
"""

from smp_fx.version import SMP_API_VERSION as __version__

__all__ = ["__version__"]
