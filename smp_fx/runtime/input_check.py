"""The first ``smp.step`` call checks that every rank of a pipeline group was given the same
batch.

Each pipeline stage reads the step's arguments on its own rank: the first stage its inputs,
the last stage (say) its labels. SMP's rule is that the ranks of one pipeline group load
the same data (data is sharded by ``smp.dp_rank()``, not by the global rank; tensor-parallel
ranks get different batches unless ``prescaled_batch``). A data loader sharded by the
global rank breaks it without any error: the stages then train on pieces of different
batches. That is what a torchrun-launched Hugging Face ``Trainer`` in
SMP mode does on GPUs, where accelerate sees ``LOCAL_RANK`` and shards its data loaders by
the world size. So the first step of a model compares a fingerprint of its tensor arguments
(shape, dtype and three sums per tensor) across the pipeline group, once: one small
object all-gather, nothing in later steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cost_model.errors import SMPRuntimeError
from smp_fx.world import comm, state


def fingerprint(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """(where, shape, dtype, sum, sum of squares, sum weighted by position) of every tensor
    argument, nested ones too; the sums as ``float.hex`` strings, exact and NaN-safe."""
    out: list[tuple[Any, ...]] = []

    def visit(value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor):
            v = value.detach().to(torch.float64).flatten()
            at = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device)
            sums = (v.sum(), (v * v).sum(), (v * at).sum())
            out.append((where, tuple(value.shape), str(value.dtype),
                        *(float(x).hex() for x in sums)))  # hex: NaN equals NaN
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{where}[{i}]")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{where}[{key!r}]")

    for i, arg in enumerate(args):
        visit(arg, f"argument {i}")
    for name, arg in kwargs.items():
        visit(arg, f"argument {name!r}")
    return out


def check_same_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str) -> None:
    """Raise on every rank when the ranks of this rank's pipeline group were given different
    tensors (a collective over that group; nothing to do in one process)."""
    st = state.get()
    if st.in_process or len(st.group_ranks(comm.PP_GROUP.axis)) < 2:
        return
    mine = fingerprint(args, kwargs)
    prints = comm.allgather(mine, comm.PP_GROUP)
    differ = [i for i, other in enumerate(prints) if other != prints[0]]
    if not differ:
        return
    first = next((a[0] for a, b in zip(prints[0], prints[differ[0]]) if a != b),
                 "the number of tensor arguments")
    ranks = st.group_ranks(comm.PP_GROUP.axis)
    raise SMPRuntimeError.build(
        "every rank of a pipeline group must be given the same batch",
        {"differs": first, "ranks": [ranks[0], ranks[differ[0]]]}, where,
        "shard the data by smp.dp_rank() / smp.dp_size(), not by the global rank (the "
        "Hugging Face Trainer: run it with the smdistributed shims, see docs/clients.md)")
