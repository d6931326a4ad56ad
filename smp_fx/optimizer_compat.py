"""What other clients read off ``smp.DistributedOptimizer``, fenced off its core.

accelerate (the Hugging Face Trainer) asks ``_is_accelerate_prepared`` and
``step_was_skipped``; AWS's ``sdp_utils.py`` reads DeepSpeed ZeRO-3's names under sharded
data parallelism (``smp_fx.parallel.ds_view``). None of it changes what a step does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from smp_fx.parallel import ds_view
from smp_fx.world import state

if TYPE_CHECKING:
    from smp_fx.model import DistributedModel


class ClientViews:
    """accelerate's flags and DeepSpeed's names, mixed into ``DistributedOptimizer``."""

    # accelerate wraps every optimizer it is given unless it says it was prepared already.
    # This one steps exactly this rank's stage parameters, outside smp.step, and needs none
    # of AcceleratedOptimizer's device placement or loss scaling; wrapped, the Trainer's
    # SMP checkpointing could not reach local_state_dict.
    _is_accelerate_prepared = True

    param_groups: list[dict[str, Any]]

    @property
    def overflow(self) -> bool:
        raise NotImplementedError  # the optimizer's own

    def _model(self) -> DistributedModel | None:
        raise NotImplementedError  # the optimizer's own

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` skipped the update (what accelerate asks of its
        optimizers): with fp16, when some rank's gradients overflowed."""
        return self.overflow

    @property
    def fp32_partitioned_groups_flat(self) -> list[ds_view.FlatGroup]:
        """Per param group, this rank's fp32 partitions end to end (``ds_view.FlatGroup``)."""
        return ds_view.flat_groups(self.param_groups)

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the model's parameters it steps."""
        model = self._model()
        if model is None or not hasattr(next(model.parameters(), None), "ds_tensor"):
            raise AttributeError("fp16_groups exists under sharded data parallelism, for "
                                 "the parameters of a smp.DistributedModel")
        return ds_view.model_groups(self.param_groups, model.parameters())

    @property
    def ds_param_shard_group(self) -> Any:
        """The process group the parameters are sharded over."""
        model = self._model()
        sharded = model.parallelized.sharded if model is not None and model.partitioned \
            else None
        return ds_view.shard_group(state.get(), sharded.mesh if sharded else None)
