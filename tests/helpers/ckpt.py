"""Checkpoint test fixtures: a tiny model with a tied weight and buffers, a plainly trained
Adam over it, how pipeline stages would split it, and a save killed half-way.

The "stages" are simulated: each holds a subset of the plain model's parameters (the tied
weight on the first and the last) and its own torch optimizer over them, as a pipeline rank
does; the checkpoint tests merge and split their states against the plain ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smp_fx.ckpt.state_dict import optimizer_state_by_name, optimizer_state_to_torch


class Tied(nn.Module):
    """Embedding and output head share one weight; a BatchNorm gives buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality, tensors by value/dtype; dict key order included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a.keys()) == list(b.keys()), f"{path}: {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` optimizer steps of ``Tied`` on random tokens (the caller seeds)."""
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randint(0, 7, (5,))).square().mean().backward()
        opt.step()


def plain_setup() -> tuple[Tied, torch.optim.Optimizer, list[list[str]]]:
    """A trained plain model and Adam with two param groups (names in optimizer order);
    seeded, so every rank of a multi-process test builds the same one."""
    torch.manual_seed(0)
    model = Tied()
    named = dict(model.named_parameters())  # tie appears once, as 'emb.weight'
    g0 = ["emb.weight", "body.0.weight", "body.0.bias"]
    g1 = [n for n in named if n not in g0]
    opt = torch.optim.Adam([{"params": [named[n] for n in g0]},
                            {"params": [named[n] for n in g1], "lr": 0.01}], lr=0.1)
    _train(model, opt, 2)
    return model, opt, [g0, g1]


STAGES_2 = [{"emb.weight", "body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"},
            {"body.2.weight", "body.2.bias", "emb.weight"}]  # tied weight replicated
STAGES_3 = [{"emb.weight", "body.0.weight"}, {"body.0.bias", "body.1.weight", "body.1.bias"},
            {"body.2.weight", "body.2.bias", "emb.weight"}]


def stage_names(stage: set[str], full: Sequence[Sequence[str]]) -> list[list[str]]:
    """The stage's parameter names per param group, in the plain optimizer's order."""
    return [[n for n in g if n in stage] for g in full]


def make_stage_optimizers(model: nn.Module, full: list[list[str]], stages: list[set[str]],
                          plain_sd: dict[str, Any]) -> list[torch.optim.Optimizer]:
    """One local Adam per stage over its parameters, loaded from the full plain state."""
    named = dict(model.named_parameters())
    by_name = optimizer_state_by_name(plain_sd, full)
    opts = []
    for stage in stages:
        local = stage_names(stage, full)
        opt = torch.optim.Adam([{"params": [named[n] for n in g]} for g in local], lr=0.5)
        opt.load_state_dict(optimizer_state_to_torch(by_name, local))
        opts.append(opt)
    return opts


def kill_mid_save(script: str, args: Sequence[str], saving: Callable[[], bool],
                  folder: Path, timeout: float = 120.0) -> None:
    """Run ``script`` (Python source, written to ``folder``) with ``args`` in a fresh
    interpreter, SIGKILL it as soon as ``saving()`` says its save is under way, and check
    it died of that signal. The script must make the save slow enough to be caught (an
    object whose pickling sleeps). The process is reaped on every path; a script that ends
    before ``saving()`` holds fails with its output, one that never gets there in
    ``timeout`` seconds fails too."""
    path = folder / "slow_save.py"
    path.write_text(script)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(path), *args], cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not saving():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the save to interrupt never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
