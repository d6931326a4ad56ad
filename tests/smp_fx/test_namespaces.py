"""SMP names known but not built: ``SMPNotImplementedError`` naming them, at the top level
and in ``smp.nn`` / ``smp.optimizers`` / ``smp.amp``; names SMP never had stay
``AttributeError``; and no name is both built and planned."""

from __future__ import annotations

from types import ModuleType

import pytest

import smp_fx
from smp_fx import amp, namespaces, nn, optimizers

SPACES: list[tuple[str, ModuleType, dict[str, str]]] = [
    ("smp", smp_fx, namespaces.PLANNED), ("smp.nn", nn, nn.PLANNED),
    ("smp.optimizers", optimizers, optimizers.PLANNED), ("smp.amp", amp, amp.PLANNED)]
PLANNED_NAMES = [(label, module, name) for label, module, known in SPACES for name in known]


@pytest.mark.parametrize(("label", "module", "name"), PLANNED_NAMES,
                         ids=[f"{label}.{name}" for label, _, name in PLANNED_NAMES])
def test_planned_names_raise_not_implemented(label: str, module: ModuleType,
                                             name: str) -> None:
    assert name not in vars(module), f"{label}.{name} is built: delete it from PLANNED"
    with pytest.raises(smp_fx.SMPNotImplementedError, match=f"'{label}.{name}'"):
        getattr(module, name)


@pytest.mark.parametrize(("label", "module"), [(label, module) for label, module, _ in SPACES])
def test_unknown_names_stay_attribute_errors(label: str, module: ModuleType) -> None:
    assert not hasattr(module, "tensor_paralelism")
    with pytest.raises(AttributeError, match="tensor_paralelism"):
        _ = module.tensor_paralelism


def test_import_from_a_namespace() -> None:
    from smp_fx import model_creation  # built since: an ordinary import

    assert model_creation is smp_fx.model_creation
    from smp_fx.nn import DistributedTransformer  # built since: an ordinary import

    assert DistributedTransformer is nn.DistributedTransformer
    from smp_fx.optimizers import FusedLamb  # built: an ordinary import

    assert FusedLamb is optimizers.FusedLamb
    with pytest.raises(ImportError):
        from smp_fx.optimizers import FusedAdamW  # noqa: F401
