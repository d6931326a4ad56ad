from __future__ import annotations

from collections import Counter

import pytest
import torch

from cost_model.errors import SMPTracingError
from passes.meta import TENSOR
from passes.shape_prop import TensorInfo, shape_prop, total_nbytes
from passes.trace import trace
from smp_fx.marking.delayed_init import delay_param_initialization
from tests.helpers.models import WithUntraceable, build, example


def _infos(gm: torch.fx.GraphModule) -> dict[str, object]:
    return {n.name: TENSOR.get(n) for n in gm.graph.nodes}


def test_shapes_dtypes_bytes_and_no_mutation() -> None:
    model, args = build("mlp", batch=4)
    gm = trace(model, args)
    out = shape_prop(gm, args)
    assert out is not gm and not any(TENSOR.has(n) for n in gm.graph.nodes)
    first = next(n for n in out.graph.nodes if n.op == "call_module")
    assert TENSOR.get(first) == TensorInfo((4, 64), "float32", 4 * 64 * 4)
    last = [n for n in out.graph.nodes if n.op == "call_module"][-1]
    assert TENSOR.get(last).shape == (4, 10)
    torch.testing.assert_close(out(*args), model(*args))


def test_tuples_non_tensors_and_layout() -> None:
    model, args = build("gpt")
    out = shape_prop(trace(model, args), args)
    split = next(n for n in out.graph.nodes if n.target == "split")
    info = TENSOR.get(split)
    assert isinstance(info, tuple) and len(info) == 3
    assert all(i == TensorInfo((2, 16, 32), "float32", 2 * 16 * 32 * 4, False) for i in info)
    assert total_nbytes(info) == 3 * 2 * 16 * 32 * 4
    size = next(n for n in out.graph.nodes if n.op == "call_function" and n.target is getattr)
    assert TENSOR.get(size) is None  # input_ids.shape: not a tensor
    ids = next(n for n in out.graph.nodes if n.op == "placeholder")
    assert TENSOR.get(ids).dtype == "int64"


def test_export_graph_and_json_roundtrip() -> None:
    model, args = build("hf_bert")
    out = shape_prop(trace(model, args), args)
    logits = [n for n in out.graph.nodes if n.op == "output"][0].args[0]
    node = logits[0] if isinstance(logits, (tuple, list)) else logits
    assert TENSOR.get(node).shape == (2, 16, example("hf_bert").VOCAB)
    info = TensorInfo((3, 4), "bfloat16", 24, False)
    assert TensorInfo.from_json(info.to_json()) == info


def test_meta_parameters_and_inputs_match_real_shapes() -> None:
    model, args = build("gpt")
    real = _infos(shape_prop(trace(model, args), args))
    with delay_param_initialization():
        meta_model = example("gpt").build_model()
    meta_args = tuple(a.to("meta") for a in args)
    gm = trace(meta_model, meta_args)
    fake = _infos(shape_prop(gm, meta_args))
    assert fake == real
    assert all(p.is_meta for p in gm.parameters())


def test_data_dependent_leaf_needs_a_real_run() -> None:
    model = WithUntraceable()
    x = torch.randn(3, 8)
    gm = trace(model, (x,))
    out = shape_prop(gm, (x,))  # falls back to one real forward: weights are real
    assert TENSOR.get(next(n for n in out.graph.nodes if n.target == "odd")).shape == (3, 8)
    with pytest.raises(SMPTracingError, match="data-dependent"):
        shape_prop(gm, (x,), allow_real_run=False)


class _AssertsMetaDevice(torch.nn.Module):
    """What export records for a model traced with meta weights: an assert that a tensor
    lives on the meta device, which fails once the tensor is on the inputs' device."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        torch.ops.aten._assert_tensor_metadata(h, dtype=h.dtype, device=torch.device("meta"))
        return h


def test_a_device_mismatch_is_named_as_such() -> None:
    x = torch.randn(2, 3)
    gm = trace(_AssertsMetaDevice(), (x,), frontend="fx")
    with pytest.raises(SMPTracingError, match="different devices") as info:
        shape_prop(gm, (x,), allow_real_run=False)
    assert "leaf" not in str(info.value)
    assert "device=x.device" in str(info.value)


def test_data_dependent_failure_suggests_a_leaf() -> None:
    x = torch.randn(3, 8)
    gm = trace(WithUntraceable(), (x,))
    with pytest.raises(SMPTracingError, match="data-dependent") as info:
        shape_prop(gm, (x,), allow_real_run=False)
    assert "make the module a leaf" in str(info.value)


def test_hf_model_built_on_meta_with_cpu_inputs() -> None:
    """``with torch.device("meta")`` weights, CPU inputs: export bakes device=meta into the
    tensors the model makes (position ids, dtype asserts); they follow the inputs."""
    ex = example("hf_gpt2")
    with torch.device("meta"):
        meta_model = ex.build_model()
    torch.manual_seed(0)
    real_model = ex.build_model()
    args = ex.example_inputs(2)
    gm = trace(meta_model, args)
    assert gm.meta["smp.frontend"] == "export"
    assert not any(n.kwargs.get("device") == torch.device("meta") for n in gm.graph.nodes)
    fake = _infos(shape_prop(gm, args, allow_real_run=False))
    real = _infos(shape_prop(trace(real_model, args), args))
    assert Counter(map(repr, fake.values())) == Counter(map(repr, real.values()))
