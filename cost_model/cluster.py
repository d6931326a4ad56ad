"""Cluster specs as data: GPUs, their nodes and the links between them, every figure sourced.

A plan at scale depends on how a node is wired as much as on its GPU: tensor parallelism
stays on NVLink, data and pipeline traffic share the node's network cards. A
``ClusterSpec`` is one GPU's ``DeviceSpec`` plus the node and the fabric.
See docs/planning.md, 'Clusters'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from cost_model.collectives import Fabric
from cost_model.datasheets import V100
from cost_model.device import GB, DeviceSpec, GiB
from cost_model.devices import get_device, load_device
from cost_model.errors import SMPConfigError
from cost_model.gpu_specs import A100_40GB, A100_80GB, B200, H100_SXM, H200_SXM, MEGATRON_FIT
from cost_model.serial import read_spec_file

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ClusterSpec:
    """One kind of node, repeated: its GPUs (``device``), their links, what memory is usable.

    Bandwidths are one direction; ``memory_reserved_bytes`` holds no tensor (CUDA
    context, cuBLAS, NCCL), ``allocator_margin`` is kept free for fragmentation."""

    name: str
    device: DeviceSpec
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    intra_node_efficiency: float = 1.0
    inter_node_efficiency: float = 1.0
    memory_reserved_bytes: int = 0
    allocator_margin: float = 0.0
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SMPConfigError:
            return SMPConfigError.build(rule, getattr(self, name), f"cluster {self.name!r}",
                                        f"fix {name} (a built-in cluster, or the file's "
                                        "figure)")

        if not isinstance(self.device, DeviceSpec):
            raise bad("device", "a cluster's device is a DeviceSpec")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise bad("gpus_per_node", "gpus_per_node must be an integer >= 1")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if not float(getattr(self, name)) > 0:
                raise bad(name, f"{name} must be > 0 bytes/s")
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            if not float(getattr(self, name)) >= 0:
                raise bad(name, f"{name} must be >= 0 s")
        for name in ("intra_node_efficiency", "inter_node_efficiency"):
            if not 0 < float(getattr(self, name)) <= 1:
                raise bad(name, f"{name} must be in (0, 1]")
        if not 0 <= float(self.allocator_margin) < 1:
            raise bad("allocator_margin", "allocator_margin must be in [0, 1)")
        if not 0 <= int(self.memory_reserved_bytes) < self.device.memory_bytes:
            raise bad("memory_reserved_bytes",
                      "memory_reserved_bytes must be >= 0 and below the GPU's memory")

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes of one GPU a plan may fill with tensors (reserve and margin taken off)."""
        return (self.device.memory_bytes - self.memory_reserved_bytes) \
            * (1.0 - self.allocator_margin)

    def fabric(self) -> Fabric:
        """The links collectives run on, at the bandwidth NCCL reaches on them."""
        return Fabric(self.intra_node_bandwidth * self.intra_node_efficiency,
                      self.intra_node_latency_s,
                      self.inter_node_bandwidth * self.inter_node_efficiency,
                      self.inter_node_latency_s, self.gpus_per_node)

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_json() if f.name == "device" else value
        out["sources"] = dict(self.sources)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterSpec:
        """Rebuild from ``to_json``; ``device`` may be a built-in spec name or a spec."""
        d = dict(data)
        version = d.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise SMPConfigError.build("unsupported ClusterSpec schema_version", version,
                                       "ClusterSpec.from_json",
                                       f"write schema {SCHEMA_VERSION} (smp-fx plan --help)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        missing = sorted(f.name for f in fields(cls) if f.name not in d
                         and f.default is MISSING and f.default_factory is MISSING)
        if unknown or missing:
            raise SMPConfigError.build("a cluster file has exactly the documented fields",
                                       {"unknown": unknown, "missing": missing},
                                       "ClusterSpec.from_json",
                                       "see docs/planning.md for the fields")
        device = d["device"]
        if isinstance(device, str):
            d["device"] = load_device(device)
        elif isinstance(device, dict):
            d["device"] = DeviceSpec.from_json(device)
        else:
            raise SMPConfigError.build("a cluster's device is a spec name or a spec object",
                                       type(device).__name__, "ClusterSpec.from_json",
                                       'write "device": "a100" or a calibrated spec')
        d["sources"] = tuple(sorted(dict(d.get("sources", {})).items()))
        return cls(**d)

    def with_sources(self, **notes: str) -> ClusterSpec:
        merged = {**dict(self.sources), **notes}
        return dataclasses.replace(self, sources=tuple(sorted(merged.items())))


# ------------------------------------------------------------------------ built-in clusters
_NCCL_A100 = ("NCCL's tuning model caps an A100's (sm80) bus bandwidth at 235 GB/s "
              "(src/graph/tuning.cc, ncclTopoTuneModel): 235 / 300")
_NCCL_H100 = ("nccl-tests all_reduce_perf bus bandwidth on 8 H100 SXM5 over NVLink: "
              "460-480 GB/s at large sizes, at least the 450 GB/s link (NVLink SHARP), "
              "docs.alayanew.com tech blog 'NCCL-tests in practice' (2026-05-06); its "
              "8 x A100 figure, 230-250 GB/s, agrees with NCCL's 235 cap")
_NET_EFFICIENCY = ("estimate: NCCL's bus bandwidth over InfiniBand / EFA reaches about 90% "
                   "of the cards' line rate; not measured")
_LATENCY = {"intra_node_latency_s": "order of magnitude of one NCCL hop over NVLink "
                                    "(NCCL's tuning model: a few microseconds); estimate",
            "inter_node_latency_s": "order of magnitude of one NCCL hop over the network "
                                    "(NCCL's tuning model: about 10 us); estimate"}
_RESERVED = ("estimate: CUDA context (~0.5 GiB), cuBLAS workspaces and the NCCL "
             "communicators of the tp, pp and dp groups (~0.5 GiB each)")
_MARGIN = "estimate: the caching allocator's fragmentation, 5% of what is left"


def _node(name: str, device: DeviceSpec, intra: float, inter: float, intra_eff: float,
          notes: dict[str, str]) -> ClusterSpec:
    sources = {**_LATENCY, "memory_reserved_bytes": _RESERVED, "allocator_margin": _MARGIN,
               "inter_node_efficiency": _NET_EFFICIENCY, **notes}
    return ClusterSpec(name, device, 8, intra, inter, 5e-6, 10e-6, intra_eff, 0.9,
                       2 * GiB, 0.05, tuple(sorted(sources.items())))


_DGX_A100 = "NVIDIA DGX A100 datasheet"
_DGX_H100 = "NVIDIA DGX H100 datasheet"
CLUSTERS: dict[str, ClusterSpec] = {c.name: c for c in (
    _node("dgx-a100-80gb", A100_80GB, 300 * GB, 200 * GB, 235 / 300, {
        "gpus_per_node": f"{_DGX_A100}: 8 A100 80GB",
        "intra_node_bandwidth": f"{_DGX_A100}: NVLink 600 GB/s per GPU through NVSwitch, "
                                "half each way",
        "inter_node_bandwidth": f"{_DGX_A100}: 8 single-port ConnectX-6 200 Gb/s HDR "
                                "InfiniBand for compute: 8 x 25 GB/s",
        "intra_node_efficiency": _NCCL_A100}),
    _node("dgx-h100", H100_SXM, 450 * GB, 400 * GB, 1.0, {
        "gpus_per_node": f"{_DGX_H100}: 8 H100 SXM5 80GB",
        "intra_node_bandwidth": f"{_DGX_H100}: NVLink 900 GB/s per GPU through NVSwitch, "
                                "half each way",
        "inter_node_bandwidth": f"{_DGX_H100}: 8 ConnectX-7 400 Gb/s (InfiniBand NDR) for "
                                "compute: 8 x 50 GB/s",
        "intra_node_efficiency": _NCCL_H100}),
    _node("dgx-h200", H200_SXM, 450 * GB, 400 * GB, 1.0, {
        "gpus_per_node": "NVIDIA DGX H200 datasheet: 8 H200 SXM 141GB",
        "intra_node_bandwidth": "NVIDIA DGX H200 datasheet: NVLink 900 GB/s per GPU "
                                "through NVSwitch, half each way",
        "inter_node_bandwidth": "NVIDIA DGX H200 datasheet: 8 ConnectX-7 400 Gb/s for "
                                "compute: 8 x 50 GB/s",
        "intra_node_efficiency": _NCCL_H100 + " (the H200 has the H100's NVLink 4)"}),
    _node("dgx-b200", B200, 900 * GB, 400 * GB, 1.0, {
        "gpus_per_node": "NVIDIA DGX B200 datasheet: 8 B200",
        "intra_node_bandwidth": "docs.vultr.com HGX B200 hardware overview: NVLink 5 / "
                                "NVSwitch 1.8 TB/s per GPU, half each way",
        "inter_node_bandwidth": "NVIDIA DGX B200 datasheet: 8 single-port ConnectX-7 "
                                "400 Gb/s for compute: 8 x 50 GB/s",
        "intra_node_efficiency": "estimate: the H100's (NVLink SHARP all-reduces reach "
                                 "the link rate); no published B200 nccl-tests figure "
                                 "was read"}),
    _node("p4d.24xlarge", A100_40GB, 300 * GB, 50 * GB, 235 / 300, {
        "gpus_per_node": "AWS EC2 P4d instance page: 8 A100 40GB",
        "intra_node_bandwidth": "AWS EC2 P4d instance page: 600 GB/s NVSwitch per GPU, "
                                "half each way",
        "inter_node_bandwidth": "AWS EC2 P4d instance page: 400 Gbps EFA networking",
        "intra_node_efficiency": _NCCL_A100}),
    _node("p5.48xlarge", H100_SXM, 450 * GB, 400 * GB, 1.0, {
        "gpus_per_node": "AWS EC2 P5 instance page: 8 H100 80GB",
        "intra_node_bandwidth": "AWS EC2 P5 instance page: 900 GB/s NVSwitch per GPU, "
                                "half each way",
        "inter_node_bandwidth": "AWS EC2 P5 instance page: 3200 Gbps EFAv2 networking",
        "intra_node_efficiency": _NCCL_H100}),
    _node("p3dn.24xlarge", V100, 150 * GB, 12.5 * GB, 0.8, {
        "gpus_per_node": "AWS EC2 P3 instance page: 8 V100 32GB (p3dn.24xlarge)",
        "intra_node_bandwidth": "NVIDIA V100 datasheet: NVLink 300 GB/s per GPU, half each "
                                "way (a hybrid cube mesh, not all-to-all)",
        "inter_node_bandwidth": "AWS EC2 P3 instance page: 100 Gbps networking "
                                "(p3dn.24xlarge)",
        "intra_node_efficiency": "estimate: NCCL rings on the cube mesh reach ~80% of "
                                 "one GPU's NVLink; not measured"}),
)}
DEVICE_CLUSTER = {"a100": "dgx-a100-80gb", "h100": "dgx-h100", "v100": "p3dn.24xlarge",
                  "h200": "dgx-h200", "b200": "dgx-b200"}
GPU_TYPE = {"dgx-a100-80gb": "A100", "p4d.24xlarge": "A100", "dgx-h100": "H100",
            "p5.48xlarge": "H100", "dgx-h200": "H200", "dgx-b200": "B200",
            "p3dn.24xlarge": "V100"}
"""The GPU type of each built-in cluster, as benchmarks/plan_validation.py groups runs."""
"""The built-in cluster whose node a ``--device NAME`` plan starts from."""


def cluster_names() -> tuple[str, ...]:
    return tuple(CLUSTERS)


def get_cluster(name: str) -> ClusterSpec:
    """A built-in cluster by name.

    >>> get_cluster("dgx-a100-80gb").gpus_per_node
    8
    """
    if name not in CLUSTERS:
        raise SMPConfigError.build("unknown cluster name", name, "cost_model.get_cluster",
                                   f"use one of {list(CLUSTERS)} or a cluster JSON file")
    return CLUSTERS[name]


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A built-in cluster by name, or a cluster JSON file (``ClusterSpec.to_json``)."""
    if name_or_path in CLUSTERS:
        return CLUSTERS[name_or_path]
    data = read_spec_file(name_or_path, "a cluster", list(CLUSTERS), "write a file")
    return ClusterSpec.from_json(data)


def cluster_for_device(device: DeviceSpec, *, gpus_per_node: int | None = None,
                       intra_node_bandwidth: float | None = None,
                       inter_node_bandwidth: float | None = None,
                       memory_bytes: int | None = None) -> ClusterSpec:
    """The cluster a plan for ``device`` runs on when no cluster is named.

    A built-in GPU gets its built-in node; any other spec is one host on its own link."""
    base = DEVICE_CLUSTER.get(device.name)
    if base is not None and device == get_device(device.name):
        cluster = CLUSTERS[base]
    else:
        link = device.link_bandwidth
        cluster = ClusterSpec(f"{device.name} host", device, gpus_per_node or 1, link, link,
                              device.link_latency_s, device.link_latency_s,
                              sources=(("intra_node_bandwidth", device.source(
                                  "link_bandwidth") or "the device spec's link"),))
    changes: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for key, value in (("gpus_per_node", gpus_per_node),
                       ("intra_node_bandwidth", intra_node_bandwidth),
                       ("inter_node_bandwidth", inter_node_bandwidth)):
        if value is not None:
            changes[key] = value
            notes[key] = "given on the command line"
    if memory_bytes is not None:
        changes["device"] = dataclasses.replace(cluster.device, memory_bytes=int(memory_bytes))
        notes["memory_bytes"] = "given on the command line"
    if changes:
        cluster = dataclasses.replace(cluster, name=f"{cluster.name} (modified)", **changes)
    return cluster.with_sources(**notes) if notes else cluster


__all__ = ["CLUSTERS", "DEVICE_CLUSTER", "GPU_TYPE", "MEGATRON_FIT", "ClusterSpec",
           "cluster_for_device", "cluster_names", "get_cluster", "load_cluster"]
