"""The tensor-parallel queries SMP's page lists on ``DistributedModel`` (SMP 1.6+).

A parameter is distributed when the rewrite sharded it (reduced over ``RDP_GROUP``),
else it goes to the default reducer (``DP_GROUP``); before partitioning nothing is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from smp_fx.marking.tensor_parallelism import marked_paths

if TYPE_CHECKING:
    from smp_fx.parallel.build import Parallelized


class TensorParallelQueries:
    """Mixed into ``DistributedModel`` (see the module docstring)."""

    if TYPE_CHECKING:
        _parallelized: Parallelized | None

        def get_module(self) -> nn.Module: ...
        def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a tensor-parallel shard (False before partitioning)."""
        return self._parallelized is not None and self._parallelized.is_distributed(param)

    def distribution_axis(self, param: torch.Tensor) -> int | None:
        """The dimension ``param`` is split along over the tp ranks, None if it is whole
        (what SMP's private ``torch.utils.get_distribution_axis`` answers)."""
        built = self._parallelized
        return built.distribution_axis(param) if built is not None else None

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is split over the tp ranks: never in smp-fx (buffers stay whole)."""
        return False

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param`` operates on the tp group's whole batch: the distributed ones."""
        return self.is_distributed_parameter(param)

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        """Whether the parameter of ``buf`` operates on the scaled batch: buffers are never
        distributed, so no."""
        return False

    def distributed_modules(self) -> Iterator[nn.Module]:
        """The tensor-parallel modules (the outermost marked ones) whose parameters the
        rewrite sharded on this rank."""
        built = self._parallelized
        if built is None:
            return
        module = self.get_module()
        sharded = {n for n, p in self.local_named_parameters() if built.is_distributed(p)}
        for path in marked_paths(module):
            prefix = f"{path}." if path else ""
            if any(n.startswith(prefix) for n in sharded):
                yield module.get_submodule(path)

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of this rank's parameters all-reduced over the ``DP_GROUP``."""
        for name, p in self.local_named_parameters():
            if not self.is_distributed_parameter(p):
                yield name, p

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of this rank's parameters all-reduced over the ``RDP_GROUP``."""
        for name, p in self.local_named_parameters():
            if self.is_distributed_parameter(p):
                yield name, p


__all__ = ["TensorParallelQueries"]
