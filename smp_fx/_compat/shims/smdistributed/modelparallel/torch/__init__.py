"""``import smdistributed.modelparallel.torch as smp`` gives ``smp_fx`` itself.

Replacing this module's entry in ``sys.modules`` makes the import system hand out the very
``smp_fx`` module object (the parent's ``torch`` attribute included), so there is one smp-fx
state per process whichever name a script uses; its submodules
(``smdistributed.modelparallel.torch.nn.huggingface.gpt2``) are ``smp_fx``'s own too
(``smp_fx._compat.alias``). SMP's private modules that AWS's examples import
(``...torch.state_mod``, ``...torch.utils``) are registered under their names
(``smp_fx._compat.private``).
"""

from __future__ import annotations

import sys

import smp_fx
from smp_fx._compat import alias, private

alias.install()
private.register()
sys.modules[__name__] = smp_fx
