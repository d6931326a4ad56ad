"""Tests for ``smp-fx checkpoint``: a partial checkpoint of two stages merges into one file
that the plain model and the plain optimizer load without smp-fx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from smp_fx.ckpt.commit import save_partial
from smp_fx.ckpt.ranks import RankInfo
from smp_fx.ckpt.state_dict import ModelLayout, local_model_state_dict, local_optimizer_state_dict
from smp_fx.cli.checkpoint import main
from smp_fx.cli.main import main as smp_fx_main
from tests.helpers.ckpt import (
    STAGES_2,
    Tied,
    assert_same,
    make_stage_optimizers,
    plain_setup,
    stage_names,
)
from tests.helpers.threads import run_thread_ranks


def write_partial_checkpoint(prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two simulated stages save partial files; returns the plain model/optimizer state."""
    model, opt, full = plain_setup()
    layout = ModelLayout.from_module(model)
    plain_opt = opt.state_dict()
    stage_opts = make_stage_optimizers(model, full, STAGES_2, plain_opt)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    owned = [STAGES_2[0] | {n for n in tensors if n.startswith("body.1.")}, STAGES_2[1]]

    def fn(rank: int, gather: Any) -> None:
        local = {n: t for n, t in tensors.items() if n in owned[rank]}
        obj = {"model_state_dict": local_model_state_dict(local, layout),
               "optimizer_state_dict": local_optimizer_state_dict(
                   stage_opts[rank].state_dict(), stage_names(STAGES_2[rank], full), full),
               "step": 2}
        save_partial(obj, prefix, RankInfo(mp_rank=rank, num_files=2, pp_degree=2,
                                           pp_rank=rank), gather)

    assert run_thread_ranks(2, fn) == [None, None]
    return model.state_dict(), plain_opt


def test_merge_produces_a_plain_torch_checkpoint(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    prefix, out = str(tmp_path / "checkpoint.pt"), str(tmp_path / "full.pt")
    plain_model, plain_opt = write_partial_checkpoint(prefix)
    assert main(["merge", prefix, "-o", out]) == 0
    assert "merged 2 file(s) saved at pp=2" in capsys.readouterr().out
    full = torch.load(out, weights_only=True)
    assert full["step"] == 2
    assert_same(dict(full["model_state_dict"]), dict(plain_model))
    assert_same(full["optimizer_state_dict"], plain_opt)
    fresh = Tied()
    fresh.load_state_dict(full["model_state_dict"], strict=True)
    named = dict(fresh.named_parameters())
    groups = [[named[n] for n in g] for g in (["emb.weight", "body.0.weight", "body.0.bias"],
                                                [n for n in named if n not in
                                                 ("emb.weight", "body.0.weight",
                                                  "body.0.bias")])]
    opt = torch.optim.Adam([{"params": groups[0]}, {"params": groups[1], "lr": 0.01}], lr=0.1)
    opt.load_state_dict(full["optimizer_state_dict"])
    assert_same(opt.state_dict(), plain_opt)


def test_info_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = str(tmp_path / "checkpoint.pt")
    write_partial_checkpoint(prefix)
    assert smp_fx_main(["checkpoint", "info", prefix]) == 0  # through the smp-fx dispatcher
    text = capsys.readouterr().out
    assert "pp=2" in text and "checkpoint.pt_1: mp_rank 1" in text
    assert main(["merge", str(tmp_path / "missing.pt"), "-o", str(tmp_path / "x.pt")]) == 1
    assert "no index" in capsys.readouterr().err
