"""``import smdistributed.modelparallel.torch as smp`` gives ``smp_fx`` itself.

Replacing this module's ``sys.modules`` entry hands out the very ``smp_fx`` module, so a
process has one smp-fx state whichever name a script uses; submodules
(``smp_fx._compat.alias``) and SMP's private modules (``smp_fx._compat.private``) follow.
"""

from __future__ import annotations

import sys

import smp_fx
from smp_fx._compat import alias, private

alias.install()
private.register()
sys.modules[__name__] = smp_fx
