"""Where this rank is for checkpointing: the file it writes and the degrees it runs at;
apart so tests can replace ``current_rank`` to play a rank of a larger job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from cost_model import schedule as sched
from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.view import Gather, Ranks
from smp_fx.world import comm

__all__ = ["Gather", "RankInfo", "current_rank"]


@dataclass(frozen=True)
class RankInfo:
    """This process's place for checkpointing; ``num_files`` is the model-parallel group's size."""

    mp_rank: int = 0
    num_files: int = 1
    pp_degree: int = 1
    pp_rank: int = 0
    tp_degree: int = 1
    tp_rank: int = 0
    placement: tuple[int, ...] = ()
    """The pipeline rank of each chunk (``virtual_pipeline_degree`` > 1); empty: one stage
    per rank. A partial file holds its rank's chunks, so a checkpoint saved with another
    placement is read like one saved at another degree."""

    def same_layout(self, index: dict[str, Any]) -> bool:
        """Whether a partial checkpoint's ``index`` was saved at these degrees and chunks,
        so this rank's file holds exactly this rank's parameters."""
        return (index["num_files"] == self.num_files and index["pp_degree"] == self.pp_degree
                and index["tp_degree"] == self.tp_degree
                and tuple(index.get("placement", ())) == self.placement)


def current_rank(ranks: Ranks) -> tuple[RankInfo, Gather]:
    """RankInfo and the mp-group gather for this process (a world of one before smp.init)."""
    cfg = ranks.config
    if cfg is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise SMPCheckpointError.build(
                "partial checkpoints in a multi-process job need smp.init",
                f"world size {dist.get_world_size()}", where="smp.save/smp.load",
                fix="call smp.init(config) before saving or loading")
        return RankInfo(), lambda value: [value]
    v = cfg.virtual_pipeline_degree
    info = RankInfo(mp_rank=ranks.axis_rank("mp"), num_files=len(ranks.group_ranks("mp")),
                    pp_degree=ranks.axis_size("pp"), pp_rank=ranks.axis_rank("pp"),
                    tp_degree=ranks.axis_size("tp"), tp_rank=ranks.axis_rank("tp"),
                    placement=sched.default_placement(cfg.pipeline, ranks.axis_size("pp"), v)
                    if v > 1 else ())
    return info, ranks.gather(comm.MP_GROUP)  # bounded, named waits
