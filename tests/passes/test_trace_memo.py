"""A model exported again in one process reuses the program (``passes.trace_memo``): the
graph reads the new model's own tensors and computes what the new model computes; what
changes a trace (an input's shape, a parameter's shape, an attribute, the mode, a tie,
``requires_grad``) misses; what the key cannot read (a hook, a closure) is exported, and
counted with its reason; the memo keeps no model alive."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable, Hashable, Iterator

import pytest
import torch
from torch import nn

from examples.models import hf_zoo
from passes import export_cache, trace_memo
from passes.trace import trace

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(trace_memo.ENV, raising=False)  # on, whatever the run's setting
    monkeypatch.setenv(export_cache.ENV, "")  # every capture the memo does not serve exports
    trace_memo.clear()
    yield
    trace_memo.clear()


def _logits(out: object) -> torch.Tensor:
    value = getattr(out, "logits", out)
    return value[0] if isinstance(value, tuple) else value  # type: ignore[return-value]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_the_same_structure_reuses_the_program_with_its_own_tensors(
        arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = hf_zoo.build(arch, seed=0), hf_zoo.build(arch, seed=1)
    x = hf_zoo.inputs(arch, 4)
    trace(first, x)
    assert (trace_memo.STATS.hits, trace_memo.STATS.stored) == (0, 1)
    reused = trace(second, x)
    assert trace_memo.STATS.hits == 1
    own = dict(second.named_parameters(remove_duplicate=False))
    held = dict(reused.named_parameters(remove_duplicate=False))
    assert held and all(held[n] is own[n] for n in held)  # the tensors, not copies
    assert set(reused.state_dict()) == set(second.state_dict())
    torch.testing.assert_close(_logits(reused(*x)), _logits(second(*x)))
    assert not torch.allclose(_logits(reused(*x)), _logits(first(*x)))
    monkeypatch.setenv(trace_memo.ENV, "0")
    assert reused.code == trace(second, x).code  # what a new export gives
    assert trace_memo.STATS.hits == 1 and trace_memo.STATS.unkeyed[f"{trace_memo.ENV}=0"] == 1


def test_a_model_built_under_delayed_init_is_keyed_without_its_construction_record() -> None:
    """The tape recording how the weights were made (its random generator's state alone
    exceeds what a key reads of a tensor) is no part of what a forward computes: two
    models built under ``delay_param_initialization`` with other seeds share one key."""
    from smp_fx.marking.delayed_init import TAPE_ATTR, delay_param_initialization

    with delay_param_initialization():
        first = hf_zoo.build("llama", marked=False, seed=0)
    with delay_param_initialization():
        second = hf_zoo.build("llama", marked=False, seed=1)
    assert getattr(first, TAPE_ATTR, None) is not None
    x = hf_zoo.inputs("llama")
    (a, why), (b, _) = trace_memo.model_key(first, x, {}), trace_memo.model_key(second, x, {})
    assert a is not None and a == b, why
    trace(first, x, frontend="export")
    reused = trace(second, x, frontend="export")
    assert trace_memo.STATS.hits == 1 and not trace_memo.STATS.unkeyed
    assert all(p.is_meta for p in reused.parameters())


def test_tied_weights_stay_tied_to_the_new_model() -> None:
    first, second = hf_zoo.build("gpt2", seed=0), hf_zoo.build("gpt2", seed=1)
    x = hf_zoo.inputs("gpt2", 4)
    trace(first, x)
    reused = trace(second, x)
    assert trace_memo.STATS.hits == 1
    wte = second.get_parameter("model.transformer.wte.weight")
    assert second.get_parameter("model.lm_head.weight") is wte
    assert reused.get_parameter("model.transformer.wte.weight") is wte
    assert reused.get_parameter("model.lm_head.weight") is wte


def _scaled(model: nn.Module) -> None:
    model.model.model.rotary_emb.attention_scaling = 2.0  # type: ignore[union-attr]


def _frozen(model: nn.Module) -> None:
    model.model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # type: ignore[index, union-attr]


def _toggled(model: nn.Module) -> None:
    model.train(not model.training)


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "an attribute": _scaled, "the mode": _toggled, "requires_grad": _frozen}


@pytest.mark.parametrize("change", list(CHANGES))
def test_what_changes_the_trace_misses(change: str) -> None:
    x = hf_zoo.inputs("llama", 4)
    trace(hf_zoo.build("llama", marked=False), x)
    changed = hf_zoo.build("llama", marked=False, seed=1)
    CHANGES[change](changed)
    graph = trace(changed, x)
    assert trace_memo.STATS.hits == 0 and trace_memo.STATS.stored == 2
    torch.testing.assert_close(_logits(graph(*x)), _logits(changed(*x)))


def test_another_shape_or_size_misses() -> None:
    trace(hf_zoo.build("llama"), hf_zoo.inputs("llama", 4))
    trace(hf_zoo.build("llama"), hf_zoo.inputs("llama", 2))  # the input's shape
    trace(hf_zoo.build("mistral"), hf_zoo.inputs("mistral", 4))  # another structure
    assert trace_memo.STATS.hits == 0 and trace_memo.STATS.stored == 3


def test_a_class_defined_again_is_another_key_and_main_gives_none() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    first = Scale
    class Scale(nn.Module):  # type: ignore[no-redef]  # the same name, another forward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    x = torch.ones(2)
    assert trace_memo.model_key(first(), (x,), {})[0] != trace_memo.model_key(Scale(), (x,), {})[0]
    Scale.__module__ = "__main__"
    key, why = trace_memo.model_key(Scale(), (x,), {})
    assert key is None and "defined in __main__" in why, why


def _key_of(**attrs: object) -> tuple[Hashable | None, str]:
    model = nn.Linear(2, 2)
    for name, value in attrs.items():
        setattr(model, name, value)
    return trace_memo.model_key(model, (torch.ones(1, 2),), {})


def test_partials_and_methods_are_keyed_by_what_they_hold() -> None:
    assert _key_of(f=functools.partial(torch.add, alpha=2))[0] != \
        _key_of(f=functools.partial(torch.add, alpha=3))[0]
    assert _key_of(f=functools.partial(torch.add, alpha=2))[0] == \
        _key_of(f=functools.partial(torch.add, alpha=2))[0]
    holder = nn.Linear(2, 2)
    assert _key_of(f=[].append)[0] is None and _key_of(f=holder.forward)[0] is None
    assert _key_of(f=torch.relu)[0] == _key_of(f=torch.relu)[0] != _key_of(f=torch.tanh)[0]


def test_a_tie_is_part_of_the_key() -> None:
    tied = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    untied = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    x = torch.randint(0, 8, (2, 3))
    assert trace_memo.model_key(tied, (x,), {})[0] != trace_memo.model_key(untied, (x,), {})[0]


def test_hooks_and_closures_have_no_key_and_are_counted() -> None:
    x = hf_zoo.inputs("llama", 4)
    hooked = hf_zoo.build("llama")
    hooked.model.model.layers[0].register_forward_hook(lambda *a: None)  # type: ignore[index, union-attr]
    scale = 2.0
    closed = hf_zoo.build("llama")
    closed.model.model.norm.rescale = lambda t: t * scale  # type: ignore[union-attr]
    for model in (hooked, hooked, closed):
        graph = trace(model, x)
        torch.testing.assert_close(_logits(graph(*x)), _logits(model(*x)))
    reasons = dict(trace_memo.STATS.unkeyed)
    assert reasons == {"module 'model.model.layers.0' has _forward_hooks": 2,
                       "module 'model.model.norm'['rescale'] is a closure "
                       "(tests.passes.test_trace_memo.test_hooks_and_closures_have_no_key_and"
                       "_are_counted.<locals>.<lambda>)": 1}, reasons
    assert trace_memo.STATS.stored == 0


def test_the_memo_keeps_no_model_and_at_most_its_capacity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_memo, "CAPACITY", 2)  # each program kept is an export
    model = hf_zoo.build("llama")
    trace(model, hf_zoo.inputs("llama", 4))
    weight = weakref.ref(next(model.parameters()))
    del model
    gc.collect()
    assert weight() is None
    for batch in range(1, trace_memo.CAPACITY + 3):
        trace(hf_zoo.build("bert"), hf_zoo.inputs("bert", batch))
    assert len(trace_memo._PROGRAMS) == trace_memo.CAPACITY
