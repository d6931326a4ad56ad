"""Golden plans: every example model under a few configurations, compared exactly.

Costs are analytic on the fixed "a100" spec, so the plans are deterministic across
machines. A mismatch prints the first differing lines; to accept a change on purpose run
``SMP_FX_UPDATE_GOLDEN=1 pytest tests/passes/test_plan_golden.py`` and review the diff.
Each model is traced and costed once (module-scoped cache) and partitioned per config.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from passes.partition_config import PartitionConfig
from passes.pipeline import analyse, partition
from smp_fx.cli.partition import load_model_file
from smp_fx.runtime.inputs.microbatch import split_inputs

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
MODELS = ("mlp", "cnn", "gpt", "hf_gpt2", "hf_bert")
# (partitions, memory_weight, pipeline)
CONFIGS = ((2, 0.2, "interleaved"), (2, 0.8, "simple"), (4, 0.8, "interleaved"),
           (4, 0.2, "simple"))
MICROBATCHES, BATCH, DEVICE = 4, 8, "a100"


def _costed(name: str) -> tuple[Any, Any]:
    module = load_model_file(str(ROOT / "examples" / "models" / f"{name}.py"))
    torch.manual_seed(0)
    model = module.build_model()
    args = split_inputs(module.example_inputs(BATCH), {}, MICROBATCHES)[0][0]
    return model, analyse(model, args, device=DEVICE)


@pytest.fixture(scope="module")
def costed() -> dict[str, Any]:
    return {}


def _check(text: str, path: Path) -> None:
    if os.environ.get("SMP_FX_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"golden file {path.name} is missing: run with SMP_FX_UPDATE_GOLDEN=1 "
                    "and review it")
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = difflib.unified_diff(expected.splitlines(), text.splitlines(), "golden",
                                    "now", lineterm="", n=2)
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"plan differs from {path.name} (SMP_FX_UPDATE_GOLDEN=1 to accept):\n"
                    f"{shown}")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("k", "w", "pipeline"), CONFIGS)
def test_golden_plan(costed: dict[str, Any], name: str, k: int, w: float,
                     pipeline: str) -> None:
    if name not in costed:
        costed[name] = _costed(name)
    _, gm = costed[name]
    cfg = PartitionConfig(num_stages=k, memory_weight=w, microbatches=MICROBATCHES,
                          pipeline=pipeline, device=DEVICE)
    plan = partition(gm, cfg, device=DEVICE).plan
    assert plan.config == cfg and len(plan.stages) == k
    _check(plan.dumps(), GOLDEN / f"plan_{name}_p{k}_w{w}_{pipeline}.json")


def test_golden_manual_plan() -> None:
    from smp_fx.marking.manual import pins_by_module_path

    model, gm = _costed("mlp_manual")
    pins = pins_by_module_path(model)
    assert {path.split(".")[1] for path in pins} == {"0", "1", "2"}
    assert set(pins.values()) == {0}
    cfg = PartitionConfig(num_stages=2, microbatches=MICROBATCHES, auto_partition=False,
                          default_partition=1, device=DEVICE)
    plan = partition(gm, cfg, device=DEVICE, pins=pins).plan
    assert plan.strategy == "manual"
    assert plan.stages[0].modules == ("blocks.[0-2]",)
    assert plan.stages[1].modules == ("blocks.[3-4]", "head")
    _check(plan.dumps(), GOLDEN / "plan_mlp_manual_p2_manual.json")
