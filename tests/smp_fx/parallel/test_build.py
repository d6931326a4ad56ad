"""The build applies the parallelisms in the documented order, and hooks the executor so.

The order is data (``ORDER``, ``POST_STEP_ORDER`` in ``smp_fx.parallel.build``) written in
docs/architecture.md; a real model on pp=2 x tp=2 x rdp=2 ranks with ddp and fp16 (all five
parallelisms at once) records what it applied and the hooks its executor runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cost_model.errors import SMPInternalError
from smp_fx.parallel.build import ORDER, POST_STEP_ORDER, PRE_STEP_ORDER, step_hooks
from smp_fx.runtime.executor.seams import StepHooks
from tests.helpers.dist import run_ranks

ROOT = Path(__file__).resolve().parents[3]


class _Part:
    """A parallelism that records its hooks' calls into ``log``."""

    def __init__(self, name: str, log: list[str], pre: bool = True, post: bool = True) -> None:
        self.name = name
        self.log = log
        self.pre, self.post = pre, post

    def hooks(self) -> StepHooks:
        return StepHooks(self.pre_step if self.pre else None,
                         self.post_step if self.post else None)

    def pre_step(self, ops: Any) -> None:
        self.log.append(f"pre {self.name}")

    def post_step(self) -> None:
        self.log.append(f"post {self.name}")


def test_hooks_run_before_in_build_order_and_after_in_the_post_step_order() -> None:
    log: list[str] = []
    parts = [_Part("tied", log), _Part("tensor_parallel", log),
             _Part("activation_checkpointing", log, pre=False, post=False),
             _Part("data_parallel", log), _Part("mixed_precision", log, post=False)]
    pre, post = step_hooks(parts)  # type: ignore[arg-type]
    for hook in pre:
        hook(())
    for after in post:
        after()
    assert log == ["pre tied", "pre tensor_parallel", "pre data_parallel",
                   "pre mixed_precision",
                   "post data_parallel", "post tied", "post tensor_parallel"]


def test_a_parallelism_without_a_place_in_the_order_is_refused() -> None:
    with pytest.raises(SMPInternalError, match="no place in the build's hook order"):
        step_hooks([_Part("pipeline_sharding", [])])  # type: ignore[list-item]
    with pytest.raises(SMPInternalError, match="mixed_precision"):
        step_hooks([_Part("mixed_precision", [])])  # an after-step hook it has no place for


def test_the_documented_order_is_the_built_one() -> None:
    """docs/architecture.md ("Composing the parallelisms") lists ORDER, then the after-step
    order; the build module's docstring lists ORDER too."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("### Composing the parallelisms"):]
    section = section[:re.search(r"\n##", section).start()]  # type: ignore[union-attr]
    build_list = section[section.index("applies them in this order"):]
    assert _names_in_order(build_list, ORDER) == list(ORDER)
    after = section[section.index("After a step"):]
    assert _names_in_order(after, POST_STEP_ORDER) == list(POST_STEP_ORDER)
    assert PRE_STEP_ORDER == ORDER
    from smp_fx.parallel import build

    assert _names_in_order(build.__doc__ or "", ORDER) == list(ORDER)


def _names_in_order(text: str, names: tuple[str, ...]) -> list[str]:
    """``names`` in the order of their first ``backticked`` mention in ``text``."""
    found = {n: m.start() for n in names if (m := re.search(f"``?{n}``?", text))}
    return sorted(found, key=found.__getitem__)


def _body() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import smp_fx as smp
    from tests.helpers.twin import Twin, init

    dist.init_process_group("gloo")
    init(2, 2, tensor_parallel_degree=2, fp16=True)
    twin = Twin("gpt")
    opt = smp.DistributedOptimizer(torch.optim.SGD(twin.dm.parameters(), lr=0.1),
                                   static_loss_scale=128.0)
    twin.smp_step()
    opt.step()
    built = twin.dm.parallelized
    ex = built.executor
    return {"applied": [p.name for p in built.applied],
            "pre": [h.__self__.name for h in ex.pre_step_hooks],  # type: ignore[attr-defined]
            "post": [h.__self__.name for h in ex.post_step_hooks],  # type: ignore[attr-defined]
            "wrapped": sorted(type(r).__name__ for r in ex.runners.values()),
            "loss_scale": (twin.dm.loss_scale, opt.loss_scale)}


@pytest.mark.multiproc
def test_all_five_parallelisms_apply_and_hook_the_executor_in_order() -> None:
    """pp=2 x tp=2 x rdp=2, ddp and fp16, GPT with its embedding tied to the LM head on
    the other stage: every rank applies all five in ORDER (expert parallelism, the sixth,
    needs MoE experts: ``test_expert_parallel``)."""
    for out in run_ranks(_body, 8, timeout=400):
        absent = ("expert_parallel", "context_parallel")  # ep and cp are 1
        assert out["applied"] == [n for n in ORDER if n not in absent]
        assert out["pre"] == ["tied", "tensor_parallel", "data_parallel", "mixed_precision"]
        assert out["post"] == [n for n in POST_STEP_ORDER if n not in absent]
        assert out["wrapped"] == ["DDPStageRunner"]
        assert out["loss_scale"] == (128.0, 128.0)  # the optimizer's, bound to the model
