"""``smp.reset()``: forget the model-specific state of this process, above the three places
holding it (context, pending resumes, translate functions).
"""

from __future__ import annotations

from smp_fx.ckpt import checkpoint_api
from smp_fx.world import context
from smp_fx.world.state_api import module_manager


def reset() -> None:
    """Forget the model-specific state (SMP's ``smp.reset()``): the ``DistributedModel``,
    its optimizer and pending loads, and the translate functions. ``smp.init``, the
    configuration and the process groups stay, so a new ``DistributedModel`` can be
    built and trained in the same process (tests, several Trainers in one script)."""
    context.clear_current_model()
    checkpoint_api.forget_pending()
    module_manager.reset()
