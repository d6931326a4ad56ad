"""``smp-fx calibrate``: the spec file it writes, its runtime fit, and bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cost_model.device import SCHEMA_VERSION
from cost_model.devices import A100, load_device
from smp_fx.cli import calibrate, runtime_fit
from smp_fx.cli import main as cli_main
from smp_fx.cli import partition as partition_cli

ROOT = Path(__file__).resolve().parents[3]


def test_quick_calibration_writes_a_spec_that_partition_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    assert cli_main.main(["calibrate", "--quick", "--steps", "3", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak fp32" in out and f"wrote {path}" in out
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["name"] == "calibrated-cpu"
    spec = load_device(str(path))
    assert spec.microbatch_overhead_s >= 0 and spec.step_overhead_s >= 0
    assert "fitted by smp-fx calibrate" in spec.source("microbatch_overhead_s")
    for figure in ("compute_scale", "overhead_scale", "optimizer_tensor_s"):
        assert "training step on one stage" in spec.source(figure)
    assert "measured" in spec.source("peak_flops_fp32")
    assert partition_cli.main([str(ROOT / "examples" / "models" / "mlp.py"), "--partitions",
                               "2", "--device", str(path), "--quiet"]) == 0
    assert "stages on calibrated-cpu" in capsys.readouterr().out


def test_bad_nproc_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert calibrate.main(["--nproc", "0"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def _two_ranks(path: str) -> bool:
    code = calibrate.main(["--quick", "--steps", "3", "-o", path])
    return code == 0


@pytest.mark.multiproc
def test_two_processes_measure_the_link_and_fit_the_pipeline(tmp_path: Path) -> None:
    """What ``smp-fx calibrate --nproc 2`` (or under ``smp-fx run -n 2``) runs on each rank:
    the link between the two, the runtime fitted on one stage by rank 0 alone, and the
    cost per message and the pipelined scale at pipeline degree 2."""
    from tests.helpers.dist import run_ranks

    path = tmp_path / "spec2.json"
    assert run_ranks(_two_ranks, 2, str(path), timeout=240) == [True, True]
    spec = load_device(str(path))
    assert "gloo between ranks 0 and 1" in spec.source("link_latency_s")
    assert spec.link_latency_s > 0 and spec.message_overhead_s > 0
    assert "one stage" in spec.source("step_overhead_s")
    assert "pipeline degree 2" in spec.source("message_overhead_s")
    assert "pipeline degree 2" in spec.source("pipelined_scale")
    lo, hi = runtime_fit.PIPELINED_LIMITS
    assert lo <= spec.pipelined_scale <= hi


def test_scales_fit_recovers_fixed_and_work_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured = 2.5 x predicted fixed costs + 1.2 x predicted work at each reference size
    is fitted back to (2.5, 1.2); absurd fits are clamped to the limits."""
    from smp_fx.cli import reference_model as ref

    rows = {(1, 8): (4e-4, 2e-4), (2, 16): (4e-4, 9e-4), (ref.BATCH, ref.SEQ): (4e-4, 6e-3)}

    def fake(spec: object, device: object, batch: int, tokens: int, repeats: int
             ) -> tuple[float, float, float]:
        fixed, work = rows[batch, tokens]
        return fixed, work, 2.5 * fixed + 1.2 * work

    monkeypatch.setattr(ref, "_size_row", fake)
    assert ref.fit_scales(A100, torch.device("cpu")) == (pytest.approx(2.5), pytest.approx(1.2))
    rows = {k: (f, w * 100) for k, (f, w) in rows.items()}
    monkeypatch.setattr(ref, "_size_row", lambda s, d, b, t, r: (*rows[b, t], 1e-9))
    assert ref.fit_scales(A100, torch.device("cpu")) == ref.LIMITS[:1] * 2


def test_joint_fit_solves_both_figures() -> None:
    """Rows (d/d per-message, d/d scale, residual) made from known figures give them back."""
    rows = [(a, b, a * 1.5e-4 + b * 0.3) for a, b in ((4000.0, 0.1), (9000.0, 0.2),
                                                       (300.0, 0.9))]
    from smp_fx.cli.reference_model import least_squares

    assert least_squares(rows) == (pytest.approx(1.5e-4), pytest.approx(0.3))
    assert least_squares([(1.0, 2.0, 3.0), (2.0, 4.0, 1.0)]) is None  # proportional


def test_conv_factor_is_fitted_in_place_and_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU the factor lies within the limits; a measured time of nothing or of an
    hour is clamped to them."""
    from smp_fx.cli import reference_model as ref

    spec = dataclasses.replace(A100, op_overheads=(("default", 5e-6, 8e-6),
                                                   ("conv", 40e-6, 120e-6)))
    lo, hi = ref.LIMITS
    assert lo <= ref.fit_conv_scale(spec, torch.device("cpu"), repeats=3) <= hi
    for seconds, limit in ((0.0, lo), (3600.0, hi)):
        ticks = iter([0.0, seconds] * 100)
        monkeypatch.setattr(ref.microbench, "clock",
                            lambda device, ticks=ticks: lambda: next(ticks))
        assert ref.fit_conv_scale(spec, torch.device("cpu"), repeats=3) == limit

