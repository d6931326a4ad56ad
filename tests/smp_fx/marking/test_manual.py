"""smp.partition / set_partition record creation-time pins without touching the model."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from cost_model.errors import SMPConfigError
from smp_fx.marking.manual import partition, partition_of, pins_by_module_path, set_partition


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)


class Model(nn.Module):
    """The example of SMP's documentation."""

    def __init__(self) -> None:
        super().__init__()
        with partition(1):
            self.child0 = Child()
            with partition(2):
                self.child1 = Child()
            self.child2 = Child()
        self.child3 = Child()


def test_seed_example_innermost_wins() -> None:
    init = nn.Module.__init__
    model = Model()
    assert nn.Module.__init__ is init, "the constructor hook is removed when contexts close"
    assert pins_by_module_path(model) == {
        "child0": 1, "child0.inner": 1, "child1": 2, "child1.inner": 2,
        "child2": 1, "child2.inner": 1}
    assert partition_of(model.child3) is None
    assert not any(k.startswith("_smp") for k in vars(model))


def test_creation_not_registration_counts() -> None:
    with partition(1):
        built_inside = nn.Linear(2, 2)
    outer = nn.Sequential(nn.Linear(2, 2))
    with partition(0):
        outer.add_module("late", built_inside)
        outer.add_module("plain", nn.ReLU())
    assert pins_by_module_path(outer) == {"late": 1, "plain": 0}


def test_set_partition_overrides() -> None:
    with partition(1):
        layer = nn.Linear(2, 2)
    set_partition(layer, 3)
    assert partition_of(layer) == 3
    with pytest.raises(SMPConfigError):
        set_partition(layer, -1)
    with pytest.raises(SMPConfigError):
        set_partition("layer", 0)  # type: ignore[arg-type]


def test_bad_index_rejected_at_once() -> None:
    with pytest.raises(SMPConfigError, match="int >= 0"):
        with partition(-1):
            pass
    with pytest.raises(SMPConfigError):
        with partition(True):  # type: ignore[arg-type]
            pass


def test_exception_inside_context_restores_and_threads_are_separate() -> None:
    init = nn.Module.__init__
    with pytest.raises(RuntimeError):
        with partition(1):
            raise RuntimeError("boom")
    assert nn.Module.__init__ is init
    made: dict[str, nn.Module] = {}
    ready, done = threading.Event(), threading.Event()

    def other() -> None:
        ready.wait(timeout=10)
        made["other"] = nn.Linear(2, 2)  # no context open in this thread
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with partition(2):
        ready.set()
        assert done.wait(timeout=10)
        made["mine"] = nn.Linear(2, 2)
    t.join(timeout=10)
    assert partition_of(made["mine"]) == 2
    assert partition_of(made["other"]) is None
    assert nn.Module.__init__ is init


def test_model_output_unchanged() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(3, 3)
    torch.manual_seed(0)
    with partition(1):
        pinned = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    torch.testing.assert_close(plain(x), pinned(x))
