"""The core guarantee: smp-fx reproduces the unpartitioned model's loss and gradients.

Every test trains the same model with smp-fx and as plain PyTorch and compares the loss,
every local parameter's gradient after each step, and the parameters and buffers after
3 optimizer steps (fp32, atol 1e-5). The reference is the unpartitioned model in one
process running the same microbatches one after another (loss / m backward each), which
is what SMP's pipeline computes; for models without batch statistics it equals the
full-batch gradient.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from smp_fx.dist import state
from tests.helpers.dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def load_example(name: str) -> ModuleType:
    """Import examples/models/<name>.py (registered in sys.modules: dataclasses need it)."""
    key = f"smp_fx_test_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "examples" / "models" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


def init(pp: int, m: int, pipeline: str, **extra: Any) -> None:
    """(Re-)initialise smp with this configuration (tests switch configurations freely)."""
    import smp_fx as smp
    from smp_fx.dist import state

    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": pipeline,
              "active_microbatches": max(m, 1), **extra})


class Pair:
    """A reference model and an smp-fx DistributedModel starting from the same weights."""

    def __init__(self, name: str, batch: int = 8, seed: int = 0) -> None:
        import smp_fx as smp

        self.ex = load_example(name)
        torch.manual_seed(seed)
        self.ref = self.ex.build_model()
        model = self.ex.build_model()
        model.load_state_dict(self.ref.state_dict())
        self.initial = {k: v.clone() for k, v in self.ref.state_dict().items()}
        self.dm = smp.DistributedModel(model)
        torch.manual_seed(seed + 1)
        self.x = self.ex.example_inputs(batch)
        self.y = self.ex.example_targets(batch)

        ex = self.ex

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            out = model(x)
            loss = ex.loss_fn(out, y)
            model.backward(loss)
            return out, loss

        self.train_step = train_step

    def reset(self) -> None:
        """Both models back to the initial weights, grads cleared."""
        with torch.no_grad():
            self.ref.load_state_dict(self.initial)
            self.dm.module.load_state_dict(self.initial)
        for p in list(self.ref.parameters()) + list(self.dm.module.parameters()):
            p.grad = None

    def ref_step(self, m: int) -> float:
        total = 0.0
        for xm, ym in zip(self.x[0].chunk(m), self.y.chunk(m)):
            loss = self.ex.loss_fn(self.ref(xm), ym)
            (loss / m).backward()
            total += loss.item() / m
        return total

    def compare(self, steps: int, m: int, lr: float = 0.05) -> float:
        """Train ``steps`` steps both ways; assert loss, grads, params, buffers agree."""
        import smp_fx as smp

        self.reset()
        ref_opt = torch.optim.SGD(self.ref.parameters(), lr=lr, momentum=0.9)
        opt = smp.DistributedOptimizer(torch.optim.SGD(self.dm.module.parameters(), lr=lr,
                                                       momentum=0.9))
        if self.dm.partitioned:
            opt._localize(self.dm)
        worst = 0.0
        ref_params = dict(self.ref.named_parameters(remove_duplicate=False))
        for _ in range(steps):
            ref_opt.zero_grad()
            opt.zero_grad()
            ref_loss = self.ref_step(m)
            _, loss_mb = self.train_step(self.dm, *self.x, self.y)
            loss = loss_mb.reduce_mean().item()
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
            worst = max(worst, abs(loss - ref_loss))
            for name, p in self.dm.local_named_parameters():
                ref = ref_params[name]
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, ref.grad, atol=1e-5, rtol=0, msg=name)
                worst = max(worst, (p.grad - ref.grad).abs().max().item())
            ref_opt.step()
            opt.step()
        ref_state = self.ref.state_dict()
        for name, t in list(self.dm.local_named_parameters()) + \
                list(self.dm.local_named_buffers()):
            torch.testing.assert_close(t.detach(), ref_state[name] if name in ref_state
                                       else ref_params[name].detach(), atol=1e-5, rtol=0,
                                       msg=name)
        return worst


MODELS = ("mlp", "cnn", "gpt", "hf_gpt2")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One intra-op thread: the machine is shared and the step threads add their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

SCHEDULES = ("simple", "interleaved")


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_in_process_grid(name: str, pp: int) -> None:
    """Every microbatch count and schedule. The model is partitioned once per microbatch
    count (the export front end specialises shapes to the traced microbatch)."""
    try:
        for m in (1, 2, 4, 8):
            init(pp, m, "simple")
            pair = Pair(name)
            for pipeline in SCHEDULES:
                init(pp, m, pipeline)
                pair.compare(3, m)
            assert pair.dm.partitioned and len(pair.dm.program.stages) == pp
    finally:
        state._reset()


def _eval_matches(pair: Pair) -> str:
    """An evaluation step (no backward, under no_grad: forward-only schedule) on every rank
    returns the reference model's outputs."""
    import smp_fx as smp

    pair.dm.eval()
    pair.ref.eval()

    @smp.step
    def evaluate(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    with torch.no_grad():
        out = evaluate(pair.dm, pair.x[0]).concat()
        torch.testing.assert_close(out, pair.ref(pair.x[0]), atol=1e-5, rtol=0)
    pair.dm.train()
    pair.ref.train()
    return "eval"


def _multi_body(pp: int) -> list[str]:
    """Runs on every rank: both schedules, mb 4, two models, one world."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    done = []
    for name in ("cnn", "gpt"):
        init(pp, 4, "simple")
        pair = Pair(name)
        for pipeline in SCHEDULES:
            init(pp, 4, pipeline)
            pair.compare(3, 4)
            done.append(f"{name}/{pipeline}")
        assert len(list(pair.dm.local_parameters())) < len(list(pair.ref.parameters()))
        done.append(_eval_matches(pair))
        state._reset()
    return done


@pytest.mark.multiproc
@pytest.mark.parametrize("pp", [2, 4])
def test_multi_process_gloo(pp: int) -> None:
    results = run_ranks(_multi_body, pp, pp, timeout=240)
    assert all(r == ["cnn/simple", "cnn/interleaved", "eval", "gpt/simple", "gpt/interleaved",
                     "eval"] for r in results)
