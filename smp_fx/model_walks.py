"""How ``nn.Module``'s walks see a ``DistributedModel``: as the wrapped module's root.

Every walk gives the wrapped module's names without a ``module.`` prefix, so names from
one walk find another's tensors; once partitioned a name gives the tensor this rank
trains. See docs/clients.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smp_fx.parallel import ds_view

if TYPE_CHECKING:
    from smp_fx.runtime.executor.seams import StageRunner


class ModuleWalks:
    """Mixed into ``DistributedModel`` ahead of ``nn.Module`` (see the module docstring)."""

    if TYPE_CHECKING:
        canonical_names: dict[str, str]
        training: bool

        @property
        def partitioned(self) -> bool: ...
        def get_module(self) -> nn.Module: ...
        def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
        def _local_runners(self) -> list[StageRunner]: ...

    def stand_in_for_root(self, module: nn.Module) -> None:
        """Read the root's own parameters as this model's (``_parameters``, read-only):
        a walk over ``_parameters`` and ``named_children()`` then misses none of them."""
        self.__dict__["_parameters"] = MappingProxyType(module._parameters)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.get_module().named_children()

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """This model under ``prefix``, then the wrapped module's modules below its root
        by their own names (the root's parameters are this model's)."""
        me: nn.Module = self  # type: ignore[assignment]
        memo = set() if memo is None else memo
        if remove_duplicate:
            if me in memo:
                return
            memo.add(me)
        yield prefix, me
        for name, child in self.named_children():
            yield from child.named_modules(memo, f"{prefix}.{name}" if prefix else name,
                                           remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """By ``named_modules()``' names: ``""`` is this model."""
        me: nn.Module = self  # type: ignore[assignment]
        return me if target == "" else self.get_module().get_submodule(target)

    def get_parameter(self, target: str) -> nn.Parameter:
        """By ``named_parameters()``' names, giving the tensor ``named_parameters()`` does."""
        original = self.get_module().get_parameter(target)
        return self._walked(self._trained(), target, original)

    def _trained(self) -> dict[str, nn.Parameter]:
        return dict(self.local_named_parameters()) if self.partitioned else {}

    def _walked(self, trained: dict[str, nn.Parameter], name: str,
                original: nn.Parameter) -> nn.Parameter:
        """What the walks give for the module's ``original`` under ``name``: the tensor
        trained under it, unless ``original`` is its DeepSpeed view (sdp)."""
        t = trained.get(self.canonical_names.get(name, name))
        return original if t is None or getattr(original, ds_view.SOURCE, None) is t else t

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's names; once partitioned, a name this rank trains gives the
        tensor it trains, so ``zero_grad``, ``requires_grad_`` and clipping reach it."""
        trained = self._trained()
        cut = len(prefix) + 1 if prefix else 0
        seen: set[int] = set()
        for name, p in self.get_module().named_parameters(prefix, recurse, False):
            p = self._walked(trained, name[cut:], p)
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            yield name, p
        if recurse:  # trained under a name the wrapped module does not have
            for name, p in trained.items():
                if id(p) not in seen and name not in self.canonical_names:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters(recurse=recurse))

    def zero_grad(self, set_to_none: bool = True) -> None:
        me: nn.Module = self  # type: ignore[assignment]
        nn.Module.zero_grad(me, set_to_none)
        if self.partitioned:  # sdp: the shards behind the originals' view
            for r in self._local_runners():
                r.stage.module.zero_grad(set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        me: nn.Module = self  # type: ignore[assignment]
        nn.Module.requires_grad_(me, requires_grad)
        if self.partitioned:
            for r in self._local_runners():
                r.stage.module.requires_grad_(requires_grad)
        return self

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.get_module().named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.get_module().buffers(recurse)

    def train(self, mode: bool = True) -> Any:
        """The wrapped module's mode, and once partitioned the local stages' (whose
        tensor-parallel modules replaced the module's)."""
        self.training = mode
        self.get_module().train(mode)
        if self.partitioned:
            for r in self._local_runners():
                r.stage.module.train(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        self.get_module().apply(fn)
        me: nn.Module = self  # type: ignore[assignment]
        fn(me)
        return self

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        self.get_module()._apply(fn, recurse)
        return self


__all__ = ["ModuleWalks"]
