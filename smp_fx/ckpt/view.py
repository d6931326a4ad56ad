"""What the checkpoint code knows of the job and of the model: values handed to it.

``Ranks`` is this process's place (ranks, group sizes, object groups, the configuration);
``CheckpointView`` adds what a model's state dicts need (its layout, tensor-parallel plan,
expert names, sdp sharding). The model and the optimizer build them from the resolved
configuration and pass them down; ``Ranks.current`` serves the API calls that may get no
model (``smp.save``, ``smp.load``, ``smp.save_checkpoint``...). See docs/checkpoints.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from smp_fx.ckpt.state_dict import ModelLayout
from smp_fx.world import comm
from smp_fx.world import state as smp_state
from smp_fx.world.context import ProcessModel

if TYPE_CHECKING:
    from passes.tensor_parallel import TensorParallelPlan
    from smp_fx.config import SMPConfig

Gather = Callable[[Any], list[Any]]
"""all_gather_object over a group: this rank's value -> every rank's, in group rank order."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job as checkpoints use it; ``state`` None: a process
    without ``smp.init``, a world of one (every rank 0, every group this process)."""

    state: smp_state.State | None = field(default=None, repr=False)

    @staticmethod
    def current() -> Ranks:
        """The place ``smp.init`` set up (a world of one before it)."""
        return Ranks(smp_state.get() if smp_state.is_initialized() else None)

    @property
    def config(self) -> SMPConfig | None:
        return None if self.state is None else self.state.config

    @property
    def rank(self) -> int:
        return 0 if self.state is None else self.state.rank

    @property
    def world_size(self) -> int:
        return 1 if self.state is None else self.state.world_size

    @property
    def alone(self) -> bool:
        """Whether this process is the whole job (no peer to gather from)."""
        return self.state is None or self.state.in_process or self.state.world_size == 1

    def axis_rank(self, axis: str) -> int:
        return 0 if self.state is None else self.state.axis_rank(axis)

    def axis_size(self, axis: str) -> int:
        """The degree of ``axis`` (in-process: the configured pipeline degree)."""
        return 1 if self.state is None else self.state.axis_size(axis)

    @property
    def cp_writer(self) -> bool:
        """Whether this rank writes its state's files: the ranks of a context-parallel group
        hold the same parameters and optimizer state, and cp rank 0 alone writes them (two
        writers of one file would race over its temporary)."""
        return self.axis_rank("cp") == 0

    def group_ranks(self, axis: str) -> list[int]:
        """World ranks of this process's ``axis`` group (``[0]`` in-process)."""
        return [0] if self.state is None else self.state.group_ranks(axis)

    def object_group(self, axis: str) -> Any:
        """The gloo group of this process's ``axis`` group (needs ``smp.init``)."""
        assert self.state is not None, "object groups exist after smp.init"
        return self.state.object_group(axis)

    def gather(self, group: comm.CommGroup) -> Gather:
        """All-gather over this process's ``group`` (bounded, named waits); alone: itself."""
        if self.alone or len(self.group_ranks(group.axis)) == 1:
            return lambda value: [value]
        return lambda value: comm.allgather(value, group)

    def world_gather(self) -> Gather | None:
        """All-gather over the world group, or None when this process is the whole job."""
        return None if self.alone else lambda value: comm.allgather(value, comm.WORLD)


@dataclass(frozen=True)
class CheckpointView:
    """What a model's state dicts read of it, handed over by ``DistributedModel``."""

    ranks: Ranks
    layout: ModelLayout
    """The plain model's state-dict keys and tied names, taken before partitioning."""
    tp_plan: TensorParallelPlan | None = None
    """Set once partitioned at ``tensor_parallel_degree`` > 1."""
    experts: frozenset[str] = frozenset()
    """FQNs of expert slices (``expert_parallel_degree`` > 1)."""
    shards_parameters: bool = False
    """Whether sharded data parallelism holds the local parameters as shards."""

    @property
    def tp_rank(self) -> int:
        return self.ranks.axis_rank("tp")


class ViewedModel(ProcessModel, Protocol):
    """A model as checkpoints read it: ``smp.DistributedModel``."""

    def checkpoint_view(self) -> CheckpointView: ...
