from __future__ import annotations

import logging
import operator
import sys

import pytest
import torch
from torch import nn

from cost_model.errors import SMPTracingError
from passes.meta import MODULE_PATH, PARAMS
from passes.trace import trace
from smp_fx.marking.delayed_init import delay_param_initialization
from tests.helpers.models import (
    EXPECTED_FRONTEND,
    DataDependent,
    WithUntraceable,
    build,
    example,
)


@pytest.mark.parametrize("name", sorted(EXPECTED_FRONTEND))
def test_example_models_trace_runnable_with_original_names(name: str) -> None:
    model, args = build(name)
    gm = trace(model, args)
    assert gm.meta["smp.frontend"] == EXPECTED_FRONTEND[name]
    torch.testing.assert_close(gm(*args), model(*args))
    assert set(gm.state_dict()) == set(model.state_dict())
    nodes = list(gm.graph.nodes)
    n_ph = sum(n.op == "placeholder" for n in nodes)
    assert [n.op for n in nodes[:n_ph]] == ["placeholder"] * n_ph  # user inputs first
    fqns = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    fqns |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for node in nodes:
        assert MODULE_PATH.has(node) and PARAMS.has(node), node.format_node()
        assert set(PARAMS.get(node)) <= fqns
        path = MODULE_PATH.get(node)
        model.get_submodule(path)  # a real module path
    used = {p for n in nodes for p in PARAMS.get(n)}
    params = dict(model.named_parameters())
    assert set(params) <= used | {n for n in fqns if n not in params}


def test_tied_weights_recorded_under_both_names() -> None:
    model, args = build("gpt")
    gm = trace(model, args)
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    assert PARAMS.get(by_target["lm_head"]) == ("lm_head.weight",)
    assert PARAMS.get(by_target["wte"]) == ("wte.weight",)
    assert gm.get_parameter("lm_head.weight") is gm.get_parameter("wte.weight")
    assert MODULE_PATH.get(by_target["h.1.attn.c_attn"]) == "h.1.attn.c_attn"
    sdpa = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert MODULE_PATH.get(sdpa) == "h.0.attn"


def test_leaf_call_module_lists_all_its_params() -> None:
    model, args = build("cnn")
    gm = trace(model, args, leaf_modules=("layer2",))
    leaf = next(n for n in gm.graph.nodes if n.target == "layer2")
    assert leaf.op == "call_module"
    assert set(PARAMS.get(leaf)) == {f"layer2.{k}" for k in model.layer2.state_dict()}
    gm2 = trace(model, args, leaf_modules=(type(model.layer1),))
    assert {n.target for n in gm2.graph.nodes if n.op == "call_module"} >= {
        "layer1", "layer2", "layer3"}
    torch.testing.assert_close(gm2(*args), model(*args))


def test_untraceable_submodule_becomes_leaf(caplog: pytest.LogCaptureFixture) -> None:
    model = WithUntraceable()
    x = torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger="smp_fx"):
        gm = trace(model, (x,))
    assert gm.meta["smp.frontend"] == "fx"
    assert gm.meta["smp.auto_leaves"] == ("odd",)
    assert any("'odd'" in r.getMessage() and "leaf" in r.getMessage() for r in caplog.records)
    leaf = next(n for n in gm.graph.nodes if n.target == "odd")
    assert leaf.op == "call_module" and PARAMS.get(leaf) == ("odd.lin.weight", "odd.lin.bias")
    for sample in (x, -x.abs() - 10):  # both branches of the data-dependent module
        torch.testing.assert_close(gm(sample), model(sample))


def test_untraceable_model_raises_documented_error() -> None:
    with pytest.raises(SMPTracingError) as info:
        trace(DataDependent(), (torch.randn(2, 8),))
    text = str(info.value)
    assert "DataDependent" in text and "<root>" in text
    assert "leaf_modules" in text and "smp.partition" in text
    assert "fx:" in text and "export:" in text


class _Talking(DataDependent):
    """Writes to stderr, then branches on a value: export fails after the write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("a line the model writes", file=sys.stderr)
        return super().forward(x)


def test_a_failed_export_logs_its_partial_graph_and_keeps_other_stderr(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="smp_fx.passes.trace"), \
            pytest.raises(SMPTracingError):
        trace(_Talking(), (torch.randn(2, 8),), frontend="export")
    err = capfd.readouterr().err
    graphs = [r.getMessage() for r in caplog.records if "partial graph" in r.getMessage()]
    assert graphs and all("def forward" in g for g in graphs)
    assert "def forward" not in err
    assert err.count("a line the model writes") == 3  # each of the three attempts passed on


def test_frontend_choice_is_honoured() -> None:
    model, args = build("mlp")
    gm = trace(model, args, frontend="export")
    assert gm.meta["smp.frontend"] == "export"
    torch.testing.assert_close(gm(*args), model(*args))
    assert MODULE_PATH.get(next(n for n in gm.graph.nodes if "linear" in n.name)) == "0"
    hf, hargs = build("hf_gpt2")
    gm = trace(hf, hargs, frontend="fx")  # fx can only hide the whole transformer in a leaf
    assert gm.meta["smp.auto_leaves"] == ("model.transformer",)
    torch.testing.assert_close(gm(*hargs), hf(*hargs))
    with pytest.raises(SMPTracingError):
        trace(model, args, frontend="jit")  # type: ignore[arg-type]


class _Kw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y * scale if scale is not None else y


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_kwargs_and_nested_inputs(frontend: str) -> None:
    model, x, s = _Kw(), torch.randn(2, 4), torch.randn(2, 4)
    gm = trace(model, (x,), {"scale": s}, frontend=frontend)  # type: ignore[arg-type]
    torch.testing.assert_close(gm(x, scale=s), model(x, scale=s))


class _HFStyle(nn.Module):
    """A Hugging Face-style forward: optional tensors and flags that it branches on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None,
                scale: float = 1.0) -> dict[str, torch.Tensor | None]:
        if use_cache:
            raise ValueError("no cache")
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask
        return {"loss": None if labels is None else (y - labels).square().mean(), "y": y}


def test_fx_traces_constant_arguments_as_the_call_passes_them() -> None:
    """None, bools and numbers the call passes (or leaves at their defaults) are traced as
    constants: the branches the call takes, placeholders under their own names; a later
    call passing a tensor where the traced one passed None fails, naming the argument."""
    model, x, labels = _HFStyle(), torch.randn(2, 4), torch.randn(2, 4)
    gm = trace(model, (x,), {"labels": labels, "use_cache": False}, frontend="fx")
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", "mask", "labels", "use_cache", "scale"]
    want = model(x, labels=labels, use_cache=False)
    got = gm(x, labels=labels, use_cache=False)
    torch.testing.assert_close(got["loss"], want["loss"])
    torch.testing.assert_close(got["y"], want["y"])
    with pytest.raises(AssertionError, match="mask has been specialized"):
        gm(x, mask=torch.ones(2, 4), labels=labels, use_cache=False)


def test_meta_model_traces_without_storage() -> None:
    with delay_param_initialization():
        model = example("gpt").build_model(n_layer=3)
    args = example("gpt").example_inputs(2)
    gm = trace(model, args)
    assert gm.meta["smp.frontend"] == "fx"
    assert all(p.is_meta for p in gm.parameters())
    assert len([n for n in gm.graph.nodes if n.op == "call_module"]) > 3 * 6


def _made_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors the forward made, lifted by export (not parameters or buffers)."""
    state = {n for n, _ in (*gm.named_parameters(remove_duplicate=False),
                            *gm.named_buffers(remove_duplicate=False))}
    found = {str(n.target): operator.attrgetter(str(n.target))(gm) for n in gm.graph.nodes
             if n.op == "get_attr" and n.target not in state}
    return {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}  # not subgraphs


@pytest.mark.parametrize("name", ["llama", "falcon"])
def test_meta_hugging_face_model_makes_its_constants_on_the_inputs_device(name: str) -> None:
    """Built under delayed init and exported with CPU inputs: the meta weights stand for
    weights on the inputs' device, so the tensors the forward makes on its weights' device
    (Falcon's index tensors, the empty tensors of a transformers 5 cache at
    ``use_cache=True``; a rotary ``to(device)``) are made there with the eager build's
    values, never on meta without them, and shape propagation runs."""
    pytest.importorskip("transformers")
    from examples.models import hf_zoo
    from passes.shape_prop import shape_prop

    with delay_param_initialization():
        model = hf_zoo.build(name, marked=False)
    args = hf_zoo.inputs(name)
    gm = trace(model, args, frontend="export")
    shape_prop(gm, args)
    want = _made_constants(trace(hf_zoo.build(name, marked=False), args, frontend="export"))
    assert all(p.is_meta for p in gm.parameters())
    assert not any(isinstance(a, torch.device) and a.type == "meta"
                   for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values()))
    got = _made_constants(gm)
    assert set(got) == set(want) and not any(t.is_meta for t in got.values())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor],
                extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(pair[0]) + pair[1] * extra["w"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_nested_container_inputs(frontend: str) -> None:
    from passes.meta import TENSOR
    from passes.shape_prop import shape_prop

    model = _Nested()
    args = ((torch.randn(2, 4), torch.randn(2, 4)), {"w": torch.randn(4)})
    gm = trace(model, args, frontend=frontend)  # type: ignore[arg-type]
    torch.testing.assert_close(gm(*args), model(*args))
    out = shape_prop(gm, args)
    lin = next(n for n in out.graph.nodes
               if n.op in ("call_module", "call_function") and "lin" in n.name)
    assert TENSOR.get(lin).shape == (2, 4)
