from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from cost_model.errors import SMPRuntimeError
from passes.input_dims import DimsOf, Fixed, Free, InputDims
from passes.trace import trace


def test_check_shapes_names_the_input_and_dimension() -> None:
    dims = InputDims((DimsOf("ids", (Free("s0", 1, None), Free("s1", 2, 64))),
                      DimsOf("mask", (Free("s0", 1, None), Fixed(8)))))
    dims.check_shapes({"ids": (3, 40), "mask": (3, 8)})
    with pytest.raises(SMPRuntimeError, match=r"admits \[2, 64\].*input 'ids' dimension 1"):
        dims.check_shapes({"ids": (3, 65), "mask": (3, 8)})
    with pytest.raises(SMPRuntimeError, match=r"equal to input 'ids' dimension 0.*'mask' "
                                              r"dimension 0"):
        dims.check_shapes({"ids": (3, 40), "mask": (4, 8)})
    with pytest.raises(SMPRuntimeError, match=r"3 dimensions.*input 'mask'"):
        dims.check_shapes({"ids": (3, 40), "mask": (3, 8, 1)})
    InputDims.free().check_shapes({"x": (1, 2, 3)})


class _Masked(nn.Module):
    """fx cannot branch on a size; export keeps batch and length free, fixes the features."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.proj(x)
        if x.shape[1] > 1:
            h = h.cumsum(1)
        return h * mask.unsqueeze(-1) if mask is not None else h


def test_export_keeps_batch_and_length_free_and_fixes_what_a_weight_reads(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _Masked()
    x, mask = torch.randn(4, 5, 6), torch.ones(4, 5)
    with caplog.at_level(logging.INFO, "smp_fx.passes.trace"):
        gm = trace(model, (x,), {"mask": mask})
    said = [r.getMessage() for r in caplog.records if "traced with" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("symbolic input dimensions: x[0, 1], mask[0, 1]")
    assert gm.meta["smp.frontend"] == "export"
    dims = gm.meta["smp.input_dims"]
    by_name = {i.name: i.dims for i in dims.inputs}
    assert by_name["x"][2] == Fixed(6)
    assert isinstance(by_name["x"][0], Free) and isinstance(by_name["x"][1], Free)
    assert by_name["mask"][:2] == by_name["x"][:2]  # the same symbols
    x2, mask2 = torch.randn(2, 9, 6), torch.ones(2, 9)
    torch.testing.assert_close(gm(x2, mask=mask2), model(x2, mask=mask2))
    dims.check(gm, (x2,), {"mask": mask2})
    with pytest.raises(SMPRuntimeError, match="input 'x' dimension 2"):
        dims.check(gm, (torch.randn(2, 9, 7),), {"mask": mask2})


def test_free_words_name_each_input_s_symbolic_dimensions() -> None:
    dims = InputDims((DimsOf("ids", (Free("s0", 2, None), Fixed(16))),
                      DimsOf("pixels", (Free("s0", 2, None), Fixed(3), Free("s1", 2, None),
                                        Free("s2", 2, None))),
                      DimsOf("scale", (Fixed(1),))))
    assert dims.free_words() == "ids[0], pixels[0, 2, 3]"
    assert InputDims((DimsOf("x", (Fixed(2),)),)).free_words() == "none"
    assert InputDims.free().free_words() == "every dimension (an fx graph)"


def test_fx_graphs_take_every_shape() -> None:
    gm = trace(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    assert gm.meta["smp.frontend"] == "fx"
    assert gm.meta["smp.input_dims"] == InputDims.free()
