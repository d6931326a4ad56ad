"""Cluster specs: built-ins sourced, JSON round trips, bad clusters rejected."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cost_model.cluster import (
    CLUSTERS,
    ClusterSpec,
    cluster_for_device,
    get_cluster,
    load_cluster,
)
from cost_model.devices import A100, get_device
from cost_model.errors import SMPConfigError

FIGURES = ("gpus_per_node", "intra_node_bandwidth", "inter_node_bandwidth",
           "intra_node_latency_s", "inter_node_latency_s", "intra_node_efficiency",
           "inter_node_efficiency", "memory_reserved_bytes", "allocator_margin")


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_every_builtin_figure_says_where_it_comes_from(name: str) -> None:
    cluster = get_cluster(name)
    for figure in FIGURES:
        assert cluster.source(figure), f"{name}.{figure} has no source"
    for figure in ("peak_flops_bf16", "mem_bandwidth", "memory_bytes", "matmul_efficiency"):
        assert cluster.device.source(figure), f"{name} device {figure} has no source"
    assert 0 < cluster.usable_memory_bytes < cluster.device.memory_bytes


def test_the_a100_clusters_carry_the_megatron_fit() -> None:
    assert "Megatron" in get_cluster("dgx-a100-80gb").device.source("matmul_efficiency")
    assert get_cluster("p4d.24xlarge").device.memory_bytes == 40 * 1024**3
    # the fit replaces the estimate only: peaks and the rest are the a100 spec's
    assert get_cluster("dgx-a100-80gb").device.peak_flops_bf16 == A100.peak_flops_bf16


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_json_round_trip(name: str, tmp_path) -> None:
    cluster = get_cluster(name)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cluster.to_json()))
    back = load_cluster(str(path))
    assert back == cluster
    assert back.sources == cluster.sources


def test_a_file_may_name_a_builtin_device(tmp_path) -> None:
    doc = {"schema_version": 1, "name": "mine", "device": "h100", "gpus_per_node": 4,
           "intra_node_bandwidth": 4e11, "inter_node_bandwidth": 1e11}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    c = load_cluster(str(path))
    assert c.device == get_device("h100") and c.gpus_per_node == 4
    assert c.fabric().intra_bandwidth == 4e11


@pytest.mark.parametrize("change, message", [
    ({"intra_node_bandwidth": 0.0}, "intra_node_bandwidth must be > 0"),
    ({"inter_node_bandwidth": -1.0}, "inter_node_bandwidth must be > 0"),
    ({"gpus_per_node": 0}, "gpus_per_node must be an integer >= 1"),
    ({"intra_node_efficiency": 1.5}, r"intra_node_efficiency must be in \(0, 1\]"),
    ({"allocator_margin": 1.0}, r"allocator_margin must be in \[0, 1\)"),
    ({"memory_reserved_bytes": 10**15}, "below the GPU's memory"),
    ({"inter_node_latency_s": -1e-6}, "inter_node_latency_s must be >= 0"),
])
def test_bad_clusters_rejected(change: dict, message: str) -> None:
    with pytest.raises(SMPConfigError, match=message):
        dataclasses.replace(get_cluster("dgx-h100"), **change)


def test_bad_cluster_files_rejected(tmp_path) -> None:
    good = get_cluster("dgx-h100").to_json()
    for doc, message in (({**good, "nics": 8}, "exactly the documented fields"),
                         ({**good, "schema_version": 9}, "schema_version"),
                         ({**good, "device": 3}, "spec name or a spec object"),
                         ([1, 2], "JSON object")):
        path = tmp_path / "c.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(SMPConfigError, match=message):
            load_cluster(str(path))
    with pytest.raises(SMPConfigError, match="built-in name or a JSON file"):
        load_cluster(str(tmp_path / "missing.json"))
    with pytest.raises(SMPConfigError, match="unknown cluster"):
        get_cluster("dgx-z9000")


def test_cluster_for_device() -> None:
    assert cluster_for_device(A100) is get_cluster("dgx-a100-80gb")
    c = cluster_for_device(A100, gpus_per_node=4, inter_node_bandwidth=5e10,
                           memory_bytes=40 * 1024**3)
    assert (c.gpus_per_node, c.inter_node_bandwidth, c.device.memory_bytes) == (
        4, 5e10, 40 * 1024**3)
    assert c.source("gpus_per_node") == "given on the command line"
    other = dataclasses.replace(A100, name="calibrated", link_bandwidth=1e10)
    host = cluster_for_device(other, gpus_per_node=8)
    assert host.intra_node_bandwidth == 1e10 and host.memory_reserved_bytes == 0
    assert isinstance(host, ClusterSpec)
    # the sourced GPUs by name: their own node, as --device h100 gets dgx-h100
    assert cluster_for_device(get_device("h200")) is get_cluster("dgx-h200")
    assert cluster_for_device(get_device("b200")) is get_cluster("dgx-b200")
