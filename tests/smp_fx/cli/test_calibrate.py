"""``smp-fx calibrate``: the spec file it writes, the flags it passes on, and bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cost_model.device import SCHEMA_VERSION, DeviceSpec
from cost_model.devices import load_device
from passes.plan import PartitionPlan
from smp_fx.calibration import runtime_fit
from smp_fx.calibration.spec import CalibrationOptions
from smp_fx.cli import calibrate
from smp_fx.cli import main as cli_main
from smp_fx.cli import partition as partition_cli

ROOT = Path(__file__).resolve().parents[3]


def _runtime_figures(spec: DeviceSpec, plans: dict[int, PartitionPlan],
                     timings: dict[int, float]) -> tuple[float, float]:
    """(per action, per step) solved from the measured steps apart from the library: the
    plans' simulated step at probed figures, the 2 x 2 system by numpy, then the
    documented floor at 0 (a negative per-action cost: the per-step cost from the first
    microbatch count alone)."""
    def step(m: int, per_action: float, per_step: float) -> float:
        priced = dataclasses.replace(spec, microbatch_overhead_s=per_action,
                                     step_overhead_s=per_step, optimizer_tensor_s=0.0,
                                     optimizer_byte_s=0.0)
        plan = dataclasses.replace(plans[m], device=priced.to_json())
        return float(plan.training_step_s(plan.simulate()))

    counts, h = sorted(plans), 1e-3
    slopes = [[(step(m, h, 0.0) - step(m, 0.0, 0.0)) / h,
               (step(m, 0.0, h) - step(m, 0.0, 0.0)) / h] for m in counts]
    gaps = [timings[m] - step(m, 0.0, 0.0) for m in counts]
    per_action, per_step = np.linalg.solve(np.array(slopes), np.array(gaps))
    if per_action < 0:
        per_action, per_step = 0.0, gaps[0] / slopes[0][1]
    return float(per_action), max(float(per_step), 0.0)


def test_quick_calibration_writes_a_spec_that_partition_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The written spec reads back, says how each figure was fitted, and its per-action
    and per-step costs are the ones the measured steps imply (or 0 where they imply less:
    this machine's load decides)."""
    seen: list[tuple[Any, ...]] = []
    fit = runtime_fit.fit_runtime

    def recorded(spec: DeviceSpec, plans: dict[int, PartitionPlan],
                 timings: dict[int, float]) -> tuple[float, float]:
        seen.append((spec, plans, timings))
        return fit(spec, plans, timings)

    monkeypatch.setattr(runtime_fit, "fit_runtime", recorded)
    path = tmp_path / "spec.json"
    assert cli_main.main(["calibrate", "--quick", "--steps", "3", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak fp32" in out and f"wrote {path}" in out
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["name"] == "calibrated-cpu"
    spec = load_device(str(path))
    assert len(seen) == 1
    per_action, per_step = _runtime_figures(*seen[0])
    assert spec.microbatch_overhead_s == pytest.approx(per_action, rel=1e-6, abs=1e-12)
    assert spec.step_overhead_s == pytest.approx(per_step, rel=1e-6, abs=1e-12)
    assert "fitted by smp-fx calibrate" in spec.source("microbatch_overhead_s")
    for figure in ("compute_scale", "overhead_scale", "optimizer_tensor_s"):
        assert "training step on one stage" in spec.source(figure)
    assert "measured" in spec.source("peak_flops_fp32")
    assert partition_cli.main([str(ROOT / "examples" / "models" / "mlp.py"), "--partitions",
                               "2", "--device", str(path), "--quiet"]) == 0
    assert "stages on calibrated-cpu" in capsys.readouterr().out


def test_flags_become_the_library_options() -> None:
    args = calibrate.build_parser().parse_args(
        ["--quick", "--steps", "3", "--name", "box", "--device", "cpu", "-o", "x.json"])
    assert calibrate.options(args) == CalibrationOptions(name="box", device="cpu",
                                                         quick=True, steps=3)
    assert calibrate.options(calibrate.build_parser().parse_args([])) == CalibrationOptions()


def test_bad_nproc_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert calibrate.main(["--nproc", "0"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
