"""The refit on a measured run: a measurement made by pricing a known cluster gives back
that cluster's factors, and the refitted cluster prices the measured configuration at the
measured step; ``smp-fx plan --measured`` prints the moved factors and writes the refit
cluster with ``--json``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_model.cluster import ClusterSpec
from cost_model.measurement import MeasuredConfig, Measurement, RankFigures
from cost_model.refit import scaled
from smp_fx.cli import main as cli_main
from smp_fx.planner.measured import SENDS, _price, refit
from smp_fx.planner.model import prepare
from smp_fx.planner.step import Setting
from tests.smp_fx.planner.conftest import gpt_inputs, link_cluster, tiny_gpt

ROOT = Path(__file__).resolve().parents[3]
CONFIG = MeasuredConfig(world=4, tp=1, pp=2, dp=2, mbs=2, microbatches=4, vp=1,
                        schedule="interleaved", recompute="none", sp=False, zero="none",
                        precision="fp32", device="a100")


def setting_of(cl: ClusterSpec, gpus: int, batch: int, precision: str) -> Setting:
    return Setting(cl, gpus, batch, precision)


def synthetic(prepared: object, truth: ClusterSpec, cfg: MeasuredConfig) -> Measurement:
    """What a run of ``cfg`` on ``truth`` measures if ``truth`` prices it exactly: each
    pipeline rank's forward and backward without its sends, the sends, the exposed
    reduction, the step."""
    p = _price(prepared, truth, Measurement(cfg, 1, 0.0, ()), "truth", setting_of)
    mo = truth.device.message_overhead_s
    ranks = []
    for i in range(cfg.world):
        r = i % cfg.pp
        t = p.ranks.times[r]
        sends = (r > 0) + (r < cfg.pp - 1)  # one per boundary, forward and backward
        m = cfg.microbatches
        actions = (("F", r, m * (t.fwd_s - sends * mo), m), ("B", r, m * (t.bwd_s - sends * mo),
                                                              m),
                   (SENDS[r > 0], r, m * 2 * sends * mo, 2 * m * sends))
        ranks.append(RankFigures(i, r, 0, i // cfg.pp, p.priced.step_time_s, actions, 0.0,
                                 p.priced.comm.dp_exposed, 0, "peak_rss"))
    return Measurement(cfg, 10, p.priced.step_time_s, tuple(ranks))


@pytest.fixture(scope="module")
def prepared() -> object:
    return prepare(tiny_gpt(), gpt_inputs, "gpt", "fx")


def test_refit_recovers_a_known_cluster_and_matches_the_measured_step(prepared) -> None:
    base = link_cluster()
    d = base.device
    truth = scaled(base, compute=3.0, overhead=0.5, message_s=200e-6, link=0.2,
                   step_s=5e-3)
    m = synthetic(prepared, truth, CONFIG)
    got = refit(prepared, base, [("m.json", m)], setting_of)
    g = got.cluster
    assert g.device.compute_scale == pytest.approx(3.0 * d.compute_scale, rel=1e-6)
    assert g.device.overhead_scale == pytest.approx(0.5 * d.overhead_scale, rel=1e-6)
    assert g.device.message_overhead_s == pytest.approx(200e-6, rel=1e-9)
    assert g.intra_node_bandwidth == pytest.approx(truth.intra_node_bandwidth, rel=1e-4)
    assert g.device.step_overhead_s == pytest.approx(5e-3, rel=1e-3)
    (_, before, after, measured), = got.checks
    assert after == pytest.approx(measured, rel=0.02) and before != pytest.approx(measured)
    assert [x.factor for x in got.moved] == ["compute_scale", "overhead_scale",
                                             "message_overhead_s", "intra_node_bandwidth",
                                             "step_overhead_s"]
    assert got.notes == ()


def test_two_runs_refit_together_and_each_lands_near_its_step(prepared) -> None:
    base = link_cluster()
    truth = scaled(base, compute=2.0, overhead=2.0, message_s=50e-6, step_s=1e-3)
    other = dataclasses.replace(CONFIG, world=2, dp=1, microbatches=8)
    runs = [("a", synthetic(prepared, truth, CONFIG)), ("b", synthetic(prepared, truth, other))]
    got = refit(prepared, base, runs, setting_of)
    for _, _, after, measured in got.checks:
        assert after == pytest.approx(measured, rel=0.02)


def test_cli_prints_the_moved_factors(prepared, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    truth = scaled(link_cluster(), compute=4.0, message_s=100e-6)
    synthetic(prepared, truth, CONFIG).save(tmp_path / "m4.json")
    args = [str(ROOT / "examples/models/gpt.py"), "--build-arg", "n_layer=4", "--build-arg",
            "n_embd=32", "--build-arg", "n_head=4", "--build-arg", "vocab_size=64",
            "--build-arg", "seq_len=16", "--inputs-arg", "seq_len=16", "--inputs-arg",
            "vocab_size=64", "--device", "a100", "--gpus", "8", "--global-batch", "16",
            "--precision", "fp32", "--fix", "pp=2,dp=4,tp=1,mbs=2,vp=1,schedule=interleaved",
            "--top", "1", "--quiet", "--measured", str(tmp_path / "m4.json"), "--json",
            str(tmp_path / "plan.json")]
    assert cli_main.main(["plan", *args]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("factor"))
    assert header.split()[:4] == ["factor", "before", "after", "x"]
    for factor in ("compute_scale", "overhead_scale", "message_overhead_s",
                   "intra_node_bandwidth", "step_overhead_s"):
        assert factor in text
    assert "m4.json at its own configuration" in text
    assert "the best plan before the refit" in text
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert [m["factor"] for m in doc["refit"]["moved"]][0] == "compute_scale"
    assert doc["refit"]["best_before_s"] != doc["best"]["step_time_s"]
    spec = ClusterSpec.from_json(doc["cluster"]).device  # the refit cluster, reusable
    assert spec.compute_scale == doc["refit"]["moved"][0]["after"] != 1.0
