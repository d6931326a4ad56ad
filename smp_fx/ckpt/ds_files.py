"""SMP's sharded-data-parallel checkpoint files under DeepSpeed's names, written beside
smp-fx's own for consolidation code such as AWS's; at pp = tp = 1 only, SMP's names for
other layouts being undocumented. See docs/checkpoints.md.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from smp_fx.ckpt.view import Ranks
from smp_fx.parallel.dtensor_check import is_dtensor

log = logging.getLogger(__name__)

MODEL_FILE = "model_0.pt"


def optimizer_file(shard_rank: int) -> str:
    return f"optimizer_{shard_rank}.pt"


def applies(model: Any, optimizer: Any, ranks: Ranks) -> bool:
    """Whether this save writes them: sharded data parallelism at pp and tp 1."""
    if model is None or optimizer is None or not model.checkpoint_view().shards_parameters:
        return False
    cfg = ranks.config
    assert cfg is not None, "sharded data parallelism runs after smp.init"
    if cfg.pipeline_parallel_degree > 1 or cfg.tensor_parallel_degree > 1:
        log.info("smp-fx: DeepSpeed-named sdp checkpoint files are written at pp 1 and tp 1 "
                 "only; this checkpoint has smp-fx's files alone")
        return False
    return True


def _named_groups(model: Any, optimizer: Any) -> list[list[tuple[str, torch.Tensor]]]:
    """The optimizer's param groups as (model name, tensor stepped) pairs."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(names[id(o)], p) for o, p in zip(originals, g["params"])]
            for originals, g in zip(optimizer.fp16_groups, optimizer.param_groups)]


def with_shapes(user_content: Any, model: Any, optimizer: Any, ranks: Ranks) -> Any:
    """``user_content`` with ``param_shapes`` and ``buffer_names`` (a dict only)."""
    if not isinstance(user_content, dict) or not applies(model, optimizer, ranks):
        return user_content
    shapes = [OrderedDict((n, torch.Size(p.shape)) for n, p in group)
              for group in _named_groups(model, optimizer)]
    buffers = [n for n, _ in model.local_named_buffers()]
    return {"param_shapes": shapes, "buffer_names": buffers, **user_content}


def _deepspeed_part(value: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    flat = value.detach().reshape(-1).float()
    pad = -flat.numel() % size
    flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.chunk(size)[rank].cpu()


def write(folder: str, model: Any, optimizer: Any, model_state: Any, ranks: Ranks) -> None:
    """On every rank of the dp group (whole values are gathered over each shard group):
    the shard ranks of the first replica write their files, dp rank 0 ``model_0.pt``."""
    for path, obj in files(folder, model, optimizer, model_state, ranks):
        torch.save(obj, path)


def files(folder: str, model: Any, optimizer: Any, model_state: Any, ranks: Ranks
          ) -> list[tuple[str, dict[str, Any]]]:
    """What ``write`` writes, as (path, object) pairs (the gathers happen here; an
    asynchronous save writes them later)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if not applies(model, optimizer, ranks):
        return out
    assert ranks.config is not None  # applies: after smp.init
    size = ranks.config.sharded_data_parallel_degree
    rank = torch.distributed.get_rank(optimizer.ds_param_shard_group)
    first_replica = ranks.group_ranks("dp").index(ranks.rank) < size and ranks.cp_writer
    groups = []
    for group in _named_groups(model, optimizer):
        parts = []
        for _, p in group:
            whole = p.full_tensor() if is_dtensor(p) else p
            parts.append(_deepspeed_part(whole, rank, size))
        groups.append(torch.cat(parts) if parts else torch.zeros(0))
    if first_replica:
        out.append((os.path.join(folder, optimizer_file(rank)),
                    {"partition_count": size, "fp32_flat_groups": groups}))
    if model_state is not None:
        plain = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
        out.append((os.path.join(folder, MODEL_FILE), {"module": plain}))
    return out


__all__ = ["MODEL_FILE", "applies", "files", "optimizer_file", "with_shapes", "write"]
