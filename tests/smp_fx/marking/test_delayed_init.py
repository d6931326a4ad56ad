"""``smp.delay_param_initialization``: meta construction, and materialisation that gives
each tensor the eager build's values (bitwise), one stage's tensors at a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx
from smp_fx.marking.delayed_init import delay_param_initialization, is_delayed, materialize
from tests.helpers.models import example
from tests.helpers.numerics import init

hf_zoo = pytest.importorskip("examples.models.hf_zoo")


def test_meta_construction_marks_modules() -> None:
    with smp_fx.delay_param_initialization():
        model = example("gpt").build_model()
    assert all(p.is_meta for p in model.parameters())
    assert getattr(model, "_smp_delayed_init", False) and is_delayed(model)
    assert model.lm_head.weight is model.wte.weight
    assert not torch.empty(1).is_meta  # the context is gone afterwards
    with delay_param_initialization(enabled=False):
        plain = nn.Linear(2, 2)
    assert not plain.weight.is_meta and not is_delayed(plain)


def test_materialize_keeps_ties_and_runs() -> None:
    with delay_param_initialization():
        model = example("gpt").build_model()
    materialize(model, "cpu")
    assert not is_delayed(model)
    assert model.lm_head.weight is model.wte.weight and not model.wte.weight.is_meta
    out = model(*example("gpt").example_inputs(2))
    assert torch.isfinite(out).all()


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def test_materialize_refuses_uninitialisable_modules() -> None:
    with delay_param_initialization():
        model = _NoReset()
    with pytest.raises(smp_fx.SMPRuntimeError, match=r"w \(_NoReset\): .*uninitialised"):
        materialize(model, "cpu")


class _MetaBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0))


def test_tensors_made_outside_the_record_are_refused_by_name() -> None:
    with torch.device("meta"):  # meta, but not smp's context: nothing recorded
        model = _MetaBuffer()
    with pytest.raises(smp_fx.SMPRuntimeError, match=r"table \(_MetaBuffer\): .*outside"):
        materialize(model, "cpu")


def test_parameters_made_outside_the_record_are_refused_not_reset() -> None:
    """A meta ``nn.Linear`` has ``reset_parameters``, but that is not the eager build's
    initialisation: refused by name, as any tensor that cannot be replayed."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(smp_fx.SMPRuntimeError, match=r"0\.weight \(Linear\): .*outside"):
        materialize(model, "cpu")


def _halves(model: nn.Module) -> list[nn.Module]:
    """The modules holding tensors, in two halves (a pp 2 cut, one holder per rank)."""
    owners = [m for m in model.modules()
              if next(iter((*m.parameters(False), *m.buffers(False))), None) is not None]
    holders = [nn.Module(), nn.Module()]
    for i, m in enumerate(owners):
        holders[2 * i // len(owners)].add_module(str(i), m)
    return holders


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("name", sorted(hf_zoo.ARCHITECTURES))
def test_each_half_materialises_as_the_eager_build(name: str) -> None:
    """Each rank's half of every zoo architecture (GPT-NeoX, Falcon and T5 among them),
    materialised alone, equals the eager build with the same seed bitwise, parameters and
    buffers (rotary frequencies, masks); the other half stays unallocated meanwhile; the
    caller's random stream is left where it was."""
    pytest.importorskip("transformers")
    eager = _tensors(hf_zoo.build(name, marked=False))
    with smp_fx.delay_param_initialization():
        model = hf_zoo.build(name, marked=False)
    first, second = _halves(model)
    rng = torch.get_rng_state()
    materialize(first, "cpu")
    assert torch.equal(rng, torch.get_rng_state())
    done = {id(m) for m in first.modules()}
    assert all(t.is_meta for m in second.modules() if id(m) not in done
               for t in (*m.parameters(False), *m.buffers(False)))
    materialize(second, "cpu")
    built = _tensors(model)
    assert built.keys() == eager.keys()
    wrong = [n for n, t in built.items() if t.is_meta or not torch.equal(t, eager[n])]
    assert wrong == []


def test_distributed_model_in_process_pp2_equals_eager(one_thread: None) -> None:
    """GPT-NeoX (rotary frequencies computed in __init__) built under delayed init and
    trained at pp 2 in one process: the first loss equals the eager model's exactly."""
    pytest.importorskip("transformers")
    init(2, 1, "simple")
    x, y = hf_zoo.inputs("gpt_neox"), hf_zoo.targets("gpt_neox")
    eager = hf_zoo.build("gpt_neox", marked=False)
    expected = hf_zoo.loss_fn(eager(*x), y)
    with smp_fx.delay_param_initialization():
        net = hf_zoo.build("gpt_neox", marked=False)
    model = smp_fx.DistributedModel(net)

    @smp_fx.step
    def train(model: Any, *xs: torch.Tensor) -> Any:
        loss = hf_zoo.loss_fn(model(*xs), y)
        model.backward(loss)
        return loss

    loss = train(model, *x).reduce_mean()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_cut_shards_materialise_as_slices_of_the_eager_build(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-parallel shards cut from delayed weights (as the rewrite cuts them, padded
    and strided) materialise as the slices of the eager build's tensors, each replayed
    alone (one full source held at a time)."""
    pytest.importorskip("transformers")
    from passes.tensor_parallel import graph
    from smp_fx.marking.init_tape import Tape, cutting

    replayed: list[int] = []
    replay = Tape.replay
    monkeypatch.setattr(Tape, "replay", lambda self, wanted: (
        replayed.append(len(wanted)), replay(self, wanted))[1])

    def cuts(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        return {n: graph.shard(graph.pad(t, 0, 3), 0, 2, rank, stride=1 + i % 2)
                for i, (n, t) in enumerate(tensors.items()) if t.dim() == 2}

    eager = _tensors(hf_zoo.build(name, marked=False))
    with smp_fx.delay_param_initialization():
        model = hf_zoo.build(name, marked=False)
    for rank in (0, 1):
        with cutting():
            shards = cuts(_tensors(model), rank)
        holder = nn.Module()
        for i, t in enumerate(shards.values()):
            holder.register_parameter(str(i), nn.Parameter(t))
        materialize(holder, "cpu")
        built = dict(zip(shards, holder.parameters()))
        want = cuts(eager, rank)
        assert built.keys() == want.keys() and len(want) > 4
        assert [n for n, t in built.items() if not torch.equal(t, want[n])] == []
        assert replayed == [0] + [1] * len(shards)  # nothing whole, then each shard alone
        replayed.clear()
    assert all(t.is_meta for t in model.parameters())  # the sources stay unallocated
