"""benchmarks/plan_validation.py: its data file parses, every row is sourced, rows price."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_validation as pv  # noqa: E402

from cost_model.cluster import GPU_TYPE, get_cluster  # noqa: E402


def test_every_row_parses_and_names_its_source() -> None:
    runs = pv.read_runs()
    assert len({r.id for r in runs}) == len(runs) >= 20
    for r in runs:
        assert len(r.source) > 30 and r.gpu == GPU_TYPE[r.cluster], r.id
        assert r.tp * r.pp * r.dp == r.gpus and r.global_batch % r.dp == 0, r.id
        assert get_cluster(r.cluster).device.peak_flops_bf16 > 0
        assert 0.2 < r.tflops_per_gpu * 1e12 / get_cluster(r.cluster).device.peak_flops_bf16 \
            < 0.7, r.id  # a published MFU, whatever the metric
    assert {r.gpu for r in runs if r.fitted} == {"A100"}


def test_the_flop_counts_are_the_sources() -> None:
    gpt3 = next(r for r in pv.read_runs() if r.id == "nemo-24.11-h100-175b-128")
    # the source's own model FLOPs per sample: 2.20E+15; MFU 49.93 % of 989 TFLOP/s
    assert abs(gpt3.step_flops() / gpt3.global_batch / 2.20e15 - 1) < 0.005
    assert abs(gpt3.tflops_per_gpu / 989 - 0.4993) < 0.002


@pytest.mark.parametrize("row", ["megatron-core-h100-7.1b", "sc21-table1-a100-1.7b"])
def test_a_row_prices_at_its_published_configuration(row: str) -> None:
    run = next(r for r in pv.read_runs() if r.id == row)
    prep = pv.prepared_for(run)
    predicted, label = pv.price(run, prep)
    assert f"tp{run.tp} pp{run.pp} dp{run.dp}" in label
    assert 0.5 < predicted / run.tflops_per_gpu < 2.0
    if run.runtime == "megatron-core":  # its overlaps hide what smp-fx's runtime exposes
        mine = dataclasses.replace(run, runtime="smp-fx", mbs=1, recompute="none")
        theirs = dataclasses.replace(run, mbs=1, recompute="none")
        assert pv.price(mine, prep)[0] < pv.price(theirs, prep)[0]
