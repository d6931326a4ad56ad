"""The SMP configuration: every parameter of SMP's table, typed, range-checked, defaulted.

``load_config`` merges a dict (or a JSON file) with ``SM_HP_MP_PARAMETERS`` (JSON, as
SageMaker sets it; it wins) and returns a frozen ``SMPConfig`` whose attribute names are the
parameter names. Everything a single rank can check is checked here; the rules that need the
world size are in ``resolve_topology``. Both run in ``smp.init`` on every rank before any
collective, so a bad configuration fails the same way everywhere and never hangs.

A known parameter whose feature smp-fx has not built is accepted at its default, and fails
with ``SMPNotImplementedError`` where the feature would be used (``require_implemented``),
never silently ignored. TensorFlow-only parameters are rejected.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from cost_model import schedule as sched
from cost_model.errors import SMPConfigError, not_implemented
from cost_model.memory import precision_of
from cost_model.schedule import SCHEDULE_NAMES
from passes.partition_config import ATTENTION_CORE, CheckpointRule, PartitionConfig
from smp_fx.expert_ranks import check_ep_divides, expert_parallel_refusal
from smp_fx.topology import Topology, normalize_placement

ENV_VAR = "SM_HP_MP_PARAMETERS"
SCHEMA_VERSION = 1

IMPLEMENTED = "implemented"
TOPOLOGY_ONLY = "topology only"
PLANNED = "planned"
ENGINE = "engine tuning"
"""Accepted with any value: it tunes how SMP's own engine runs (its server, its
communication), which smp-fx's runtime does differently; what is computed is the same."""


@dataclass(frozen=True)
class Param:
    """One configuration parameter: its type, valid values, default and build status.

    ``default is None`` means "resolved from other fields" (or required, for the degree);
    ``used_at`` names the API that must call ``SMPConfig.require_implemented`` for it.
    """

    name: str
    kind: type
    default: Any
    status: str = IMPLEMENTED
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    used_at: str = ""
    doc: str = ""


_P = Param
PARAMS: tuple[Param, ...] = (
    _P("pipeline_parallel_degree", int, None, minimum=1,
       doc="required; number of pipeline stages (alias: partitions)"),
    _P("microbatches", int, 1, minimum=1, doc="microbatches per step; batch must divide"),
    _P("pipeline", str, "interleaved", choices=SCHEDULE_NAMES,
       doc="schedule (docs/schedules.md); zero_bubble and zbv are smp-fx extensions"),
    _P("virtual_pipeline_degree", int, 1, minimum=1,
       doc="smp-fx extension (SMP has no such key): chunks per pipeline rank "
           "(docs/schedules.md)"),
    _P("recompute_granularity", str, "none", choices=("none", "selective"),
       doc="smp-fx extension (SMP has no such key): selective recomputes every attention "
           "core in backward and keeps the rest (Megatron's selective recomputation; "
           "docs/memory.md); whole modules: smp.set_activation_checkpointing"),
    _P("optimize", str, "memory", choices=("memory", "speed"),
       doc="sets memory_weight's default; at tp > 1, memory: sequence-parallel activations"
           " between the tp pairs"),
    _P("placement_strategy", str, "cluster", doc="cluster, spread or a permutation of DPT"),
    _P("auto_partition", bool, True, doc="automatic partitioning"),
    _P("default_partition", int, 0, minimum=0,
       doc="stage of unpinned modules; required when auto_partition is false"),
    _P("memory_weight", float, None, minimum=0.0, maximum=1.0,
       doc="0.2 if optimize is speed, else 0.8"),
    _P("ddp", bool, False, doc="data parallelism over the dp group"),
    _P("active_microbatches", int, None, minimum=1, doc="pipeline_parallel_degree + 2 where "
       "a cap shortens the warm-up (simple; v = 1), else microbatches"),
    _P("deterministic_server", bool, False,
       doc="accepted; smp-fx's executor is deterministic by construction"),
    _P("offload_activations", bool, False,
       doc="checkpointed regions' inputs leave the device between forward and backward; "
           "needs microbatches > 1 and activation checkpointing"),
    _P("compile", str, "none", choices=("none", "inductor", "aot_eager"),
       used_at="DistributedModel",
       doc="smp-fx extension (SMP has no such key): each pipeline stage under torch.compile "
           "with this backend (aot_eager: the capture without code generation), its backward "
           "through AOTAutograd; what cannot compile runs eagerly and is logged "
           "(docs/runtime.md)"),
    _P("activation_loading_horizon", int, 4, minimum=1,
       doc="schedule tasks before a microbatch's backward its offloaded inputs start back"),
    _P("tensor_parallel_degree", int, 1, minimum=1, used_at="DistributedModel",
       doc="linears of marked modules sharded (docs/tensor_parallel.md)"),
    _P("context_parallel_degree", int, 1, minimum=1, used_at="DistributedModel",
       doc="smp-fx extension (SMP v2's key, not SMP v1's): the sequence split over this many "
           "ranks, attention over the whole (docs/context_parallel.md)"),
    _P("context_parallel_local_outputs", bool, False, used_at="DistributedModel",
       doc="smp-fx extension (SMP has no such key): at context_parallel_degree > 1 the "
           "model's outputs stay this rank's tokens (smp.cp_positions names them) instead "
           "of being gathered whole (docs/context_parallel.md)"),
    _P("fp16", bool, False, used_at="DistributedModel",
       doc="half-precision model, fp32 master weights and loss scaling in "
           "DistributedOptimizer (docs/precision.md)"),
    _P("fp16_params", bool, False, used_at="DistributedModel",
       doc="parameters held in half precision (implied by fp16)"),
    _P("shard_optimizer_state", bool, False, used_at="DistributedOptimizer",
       doc="ZeRO-1: each stage's optimizer state sharded over its rdp group; needs ddp"),
    _P("prescaled_batch", bool, False, used_at="DistributedModel",
       doc="true: tp ranks share the batch; false: each its own"),
    _P("skip_tracing", bool, False, used_at="DistributedModel",
       doc="planning never runs the model on real tensors (smp-fx's trace is symbolic or on "
           "fake tensors anyway; the one real-run fallback of shape propagation is refused, "
           "a leaf that fake tensors cannot run is not costed on real zeros, and "
           "trace_execution_times / trace_memory_usage are rejected)"),
    _P("sharded_data_parallel_degree", int, 1, minimum=1, used_at="DistributedModel",
       doc="FSDP2 over groups of this many rdp ranks (docs/precision.md); needs ddp"),
    _P("expert_parallel_degree", int, 1, minimum=1, used_at="DistributedModel",
       doc="smp-fx extension (SMP v2's name): each MoE block's experts split over groups of "
           "this many rdp ranks, tokens sent to them by all-to-all (docs/expert_parallel.md); "
           "must divide the rdp degree and every model's number of experts; needs ddp"),
    _P("sdp_reduce_bucket_size", int, 500_000_000, minimum=1, used_at="DistributedModel",
       doc="elements per FSDP2 unit (one all-gather and one reduce-scatter each)"),
    _P("sdp_param_persistence_threshold", int, 1_000_000, minimum=0,
       used_at="DistributedModel",
       doc="parameters with fewer elements are replicated, not sharded"),
    _P("sdp_max_live_parameters", int, 1_000_000_000, minimum=1, used_at="DistributedModel",
       doc="bound on gathered parameter elements; a plan above it is rejected"),
    _P("sdp_hierarchical_allgather", bool, True, used_at="DistributedModel",
       doc="true on one node (flat = hierarchical); explicit true on several nodes is "
           "rejected"),
    _P("sdp_gradient_clipping", float, 1.0, minimum=0.0, used_at="DistributedModel",
       doc="with sdp, the global gradient norm is clipped to this at optimizer.step (0: off)"),
    # SMP 1.11-1.15
    _P("bf16", bool, False, used_at="DistributedModel",
       doc="bf16 weights, fp32 master weights in DistributedOptimizer, no loss scaling "
           "(docs/precision.md); excludes fp16"),
    _P("delayed_parameter_initialization", bool, False,
       doc="smp.model_creation creates the parameters on the meta device; each stage's are "
           "initialised on the rank that holds it (smp.delay_param_initialization)"),
    _P("tensor_parallel_seed", int, 0, PLANNED, minimum=0, used_at="DistributedModel",
       doc="SMP's separate seed for random ops inside tensor-parallel modules; smp-fx draws "
           "them from torch's generator, as one process does"),
    _P("static_mode", bool, False, ENGINE,
       doc="SMP's server skips per-step request exchange; smp-fx's schedules are static "
           "action lists already"),
    _P("fast_mode", bool, False, ENGINE,
       doc="SMP sends child-to-child instead of through the parent module; smp-fx sends "
           "stage to stage already"),
    _P("ddp_port", int, None, ENGINE, minimum=0,
       doc="port of SMP's DDP process group; smp-fx's data parallelism uses the process "
           "group smp.init made; needs ddp"),
    _P("ddp_dist_backend", str, "auto", ENGINE, choices=("auto", "nccl"),
       doc="SMDDP or NCCL collectives for sharded data parallelism (SMP 1.13); smp-fx uses "
           "the backend of smp.init (SMP_FX_BACKEND)"),
    # keys AWS's example notebooks write that SMP's parameter page does not list
    _P("checkpoint_attentions", bool, False, used_at="DistributedModel",
       doc="the attention core of every smp.nn DistributedAttentionLayer (SMP's attention "
           "inside its transformer) is recomputed in backward, unless a module around it is "
           "checkpointed"),
    _P("overlapping_allreduce", bool, True,
       doc="DistributedModel's overlapping_allreduce where the call does not pass it "
           "(SMP's BERT tutorial sets it here)"),
    _P("async_checkpoint", bool, False,
       doc="smp-fx extension (SMP has no such key): smp.save_checkpoint's async_save "
           "default; the state is written by a background thread (docs/checkpoints.md)"),
    _P("_match_weights", bool, False, ENGINE,
       doc="SMP's switch giving tensor-parallel shards the unpartitioned model's weights; "
           "smp-fx cuts every shard from those weights, so they always match"),
    _P("_fp32_grad_accumulation", bool, False, PLANNED, used_at="DistributedModel",
       doc="fp32 main_grad buffers accumulating half gradients across microbatches"),
)
BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
DEFAULTS: dict[str, Any] = {p.name: p.default for p in PARAMS}
"""Every parameter's default, copied to fill a configuration in (the planner validates
hundreds of thousands of configurations per search)."""
ALIASES: dict[str, str] = {"partitions": "pipeline_parallel_degree"}
TENSORFLOW_ONLY: tuple[str, ...] = ("contiguous", "horovod")

ConfigSource = Union[Mapping[str, Any], str, "os.PathLike[str]", "SMPConfig", None]


@dataclass(frozen=True)
class SMPConfig:
    """The resolved configuration; attribute names are the SMP parameter names."""

    pipeline_parallel_degree: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    virtual_pipeline_degree: int = 1
    recompute_granularity: str = "none"
    optimize: str = "memory"
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int = 0
    memory_weight: float = 0.8
    ddp: bool = False
    active_microbatches: int = 3
    deterministic_server: bool = False
    offload_activations: bool = False
    compile: str = "none"
    activation_loading_horizon: int = 4
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    context_parallel_local_outputs: bool = False
    fp16: bool = False
    fp16_params: bool = False
    shard_optimizer_state: bool = False
    prescaled_batch: bool = False
    skip_tracing: bool = False
    sharded_data_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    sdp_reduce_bucket_size: int = 500_000_000
    sdp_param_persistence_threshold: int = 1_000_000
    sdp_max_live_parameters: int = 1_000_000_000
    sdp_hierarchical_allgather: bool = True
    sdp_gradient_clipping: float = 1.0
    bf16: bool = False
    delayed_parameter_initialization: bool = False
    tensor_parallel_seed: int = 0
    static_mode: bool = False
    fast_mode: bool = False
    ddp_port: int | None = None
    ddp_dist_backend: str = "auto"
    checkpoint_attentions: bool = False
    overlapping_allreduce: bool = True
    async_checkpoint: bool = False
    _match_weights: bool = False
    _fp32_grad_accumulation: bool = False
    explicit: frozenset[str] = field(default=frozenset(), compare=False)
    """Names the user set (a default is never 'in use' for ``require_implemented``)."""

    @property
    def partitions(self) -> int:
        """SMP's older name for ``pipeline_parallel_degree``."""
        return self.pipeline_parallel_degree

    @property
    def placement(self) -> str:
        """``placement_strategy`` as a permutation of D, P, T (``cluster`` -> ``DPT``)."""
        return normalize_placement(self.placement_strategy)

    def values(self) -> dict[str, Any]:
        """Every parameter name -> value (resolved)."""
        return {p.name: getattr(self, p.name) for p in PARAMS}

    def require_implemented(self, name: str) -> None:
        """Raise ``SMPNotImplementedError`` if ``name`` is set away from its default but its
        feature is not built. Call it where the feature would be used (see ``Param.used_at``).
        """
        param = _known(name)
        if param.status in (IMPLEMENTED, ENGINE):
            return
        value = getattr(self, name)
        if value != param.default:
            raise not_implemented(
                f"{param.status}; set to {value!r}, default {param.default!r}", name,
                f"remove '{name}' from the configuration or set it to {param.default!r}")

    def check_features(self, used_at: str) -> None:
        """``require_implemented`` for every parameter whose feature ``used_at`` would use."""
        for p in PARAMS:
            if p.used_at == used_at:
                self.require_implemented(p.name)

    def partition_config(self, device: str | None = None,
                         optimizer_state_factor: float = 2.0,
                         checkpointing: tuple[CheckpointRule, ...] = (),
                         data_parallel_degree: int = 1) -> PartitionConfig:
        """What the compiler needs of this configuration, planning for the spec ``device``.

        The one translation from SMP parameters to the compiler's ``PartitionConfig``:
        ``smp-fx partition`` and ``DistributedModel`` both use it, so that they make the
        same plan from the same configuration. ``recompute_granularity: selective`` adds
        the whole model's ``attention_core`` rule to ``checkpointing``; the precision flags
        and the sharding (over ``data_parallel_degree``, the rdp ranks) set the state model.
        """
        if self.recompute_granularity == "selective":
            checkpointing = (*checkpointing, CheckpointRule("", ATTENTION_CORE))
        sdp = self.sharded_data_parallel_degree
        zero = "fsdp" if sdp > 1 else "zero1" if self.shard_optimizer_state else "none"
        return PartitionConfig(
            precision=precision_of(self.fp16, self.bf16), zero=zero,
            data_parallel_degree=sdp if sdp > 1 else data_parallel_degree,
            persistence_threshold=self.sdp_param_persistence_threshold,
            num_stages=self.pipeline_parallel_degree, memory_weight=float(self.memory_weight),
            microbatches=self.microbatches, pipeline=self.pipeline,
            active_microbatches=self.active_microbatches, auto_partition=self.auto_partition,
            default_partition=self.default_partition,
            optimizer_state_factor=optimizer_state_factor, device=device,
            checkpointing=checkpointing, offload_activations=self.offload_activations,
            virtual_stages=self.virtual_pipeline_degree)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA_VERSION, "values": self.values(),
                           "explicit": sorted(self.explicit)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SMPConfig:
        data = json.loads(text)
        if data.get("schema") != SCHEMA_VERSION:
            raise SMPConfigError.build("unsupported SMPConfig schema", data.get("schema"),
                                       "SMPConfig.from_json", f"use schema {SCHEMA_VERSION}")
        return cls(**data["values"], explicit=frozenset(data["explicit"]))


def load_config(config: ConfigSource = None,
                env: Mapping[str, str] | None = None) -> SMPConfig:
    """Dict / JSON path / None, overridden key by key by ``SM_HP_MP_PARAMETERS`` -> SMPConfig.

    >>> load_config({"partitions": 2, "microbatches": 4}, env={}).active_microbatches
    4
    """
    env = os.environ if env is None else env
    if isinstance(config, SMPConfig):
        base: dict[str, Any] = {n: getattr(config, n) for n in config.explicit}
    else:
        base = _canonical(_read_source(config), "the configuration passed to smp.init")
    text = env.get(ENV_VAR, "").strip()
    if text:
        try:
            override = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SMPConfigError.build(f"{ENV_VAR} must hold a JSON object", text[:80],
                                       ENV_VAR, f"fix the JSON ({exc})") from exc
        base.update(_canonical(override, f"the {ENV_VAR} environment variable"))
    return _resolve(base)


def _read_source(config: Any) -> Mapping[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError as exc:
            raise SMPConfigError.build("configuration file not found", path, "smp.init",
                                       "pass an existing JSON file or a dict") from exc
        except json.JSONDecodeError as exc:
            raise SMPConfigError.build("configuration file is not valid JSON", path,
                                       "smp.init", f"fix the JSON ({exc})") from exc
        except (OSError, ValueError) as exc:  # a folder, no permission, a NUL in the name
            raise SMPConfigError.build("configuration file cannot be read", path, "smp.init",
                                       f"pass a readable JSON file or a dict ({exc})") from exc
    if isinstance(config, Mapping):
        return config
    raise SMPConfigError.build("configuration must be a dict, a JSON file path or None",
                               type(config).__name__, "smp.init", "pass a dict of parameters")


def _canonical(raw: Any, where: str) -> dict[str, Any]:
    """Reject unknown/TensorFlow keys, fold aliases (a conflict is an error), check types."""
    if not isinstance(raw, Mapping):
        raise SMPConfigError.build("configuration must be a JSON object / dict",
                                   type(raw).__name__, where, "pass {name: value, ...}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in TENSORFLOW_ONLY:
            raise SMPConfigError.build(f"'{key}' is a TensorFlow-only parameter", value, where,
                                       f"remove '{key}'; smp-fx implements the PyTorch API")
        name = ALIASES.get(key, key)
        if name not in BY_NAME:
            known = [*BY_NAME, *ALIASES]
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else "see docs/parameters.md"
            raise SMPConfigError.build(f"unknown configuration parameter '{key}'", value,
                                       where, hint)
        checked = _check_value(BY_NAME[name], value, where, key)
        if name in out and out[name] != checked:
            raise SMPConfigError.build(
                "'partitions' and 'pipeline_parallel_degree' are the same parameter and "
                "disagree", {"partitions": raw.get("partitions"),
                             "pipeline_parallel_degree": raw.get("pipeline_parallel_degree")},
                where, "give only one of them")
        out[name] = checked
    return out


def _check_value(p: Param, value: Any, where: str, key: str) -> Any:
    place = f"'{key}' in {where}"
    if p.kind is bool:
        if not isinstance(value, bool):
            raise SMPConfigError.build(f"'{key}' must be a bool", value, place, "use true/false")
        return value
    if p.kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # SMP's documentation writes 5e8 for integer sizes
        if isinstance(value, bool) or not isinstance(value, int):
            raise SMPConfigError.build(f"'{key}' must be an int", value, place,
                                       "use a whole number")
    elif p.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SMPConfigError.build(f"'{key}' must be a number", value, place,
                                       "use a float")
        value = float(value)
    elif p.kind is str:
        if not isinstance(value, str):
            raise SMPConfigError.build(f"'{key}' must be a string", value, place,
                                       f"use one of {p.choices}" if p.choices else None)
        if p.name == "placement_strategy":
            normalize_placement(value)  # raises with the valid choices
        elif p.choices and value not in p.choices:
            raise SMPConfigError.build(f"'{key}' must be one of {', '.join(p.choices)}", value,
                                       place, f"use one of {p.choices}")
    if p.minimum is not None and value < p.minimum:
        raise SMPConfigError.build(f"'{key}' must be >= {p.minimum}", value, place,
                                   f"use a value >= {p.minimum}")
    if p.maximum is not None and value > p.maximum:
        raise SMPConfigError.build(f"'{key}' must be <= {p.maximum}", value, place,
                                   f"use a value <= {p.maximum}")
    return value


def _resolve(given: dict[str, Any]) -> SMPConfig:
    """Fill defaults (including the derived ones) and check rules that span fields."""
    where = "the smp configuration"
    if "pipeline_parallel_degree" not in given:
        raise SMPConfigError.build(
            "'pipeline_parallel_degree' (or 'partitions') is required", None, where,
            "add e.g. {\"pipeline_parallel_degree\": 1} (pass it to smp.init, --config or "
            f"{ENV_VAR})")
    values = dict(DEFAULTS)
    values.update(given)
    pp = values["pipeline_parallel_degree"]
    if values["memory_weight"] is None:
        values["memory_weight"] = 0.2 if values["optimize"] == "speed" else 0.8
    if values["active_microbatches"] is None:
        values["active_microbatches"] = sched.default_active(
            values["pipeline"], pp, values["microbatches"], values["virtual_pipeline_degree"])
    sched.check_config(values["pipeline"], pp, values["microbatches"],
                       values["virtual_pipeline_degree"],
                       values["active_microbatches"] if "active_microbatches" in given else None)
    if not values["auto_partition"] and "default_partition" not in given:
        raise SMPConfigError.build("'auto_partition': false requires 'default_partition'",
                                   None, where, "add 'default_partition' (a stage index)")
    if values["default_partition"] >= pp:
        raise SMPConfigError.build(
            f"'default_partition' must be < pipeline_parallel_degree ({pp})",
            values["default_partition"], where, f"use a stage in [0, {pp})")
    if values["offload_activations"] and min(values["microbatches"],
                                             values["active_microbatches"]) < 2:
        raise SMPConfigError.build(
            "'offload_activations' needs 'microbatches' and 'active_microbatches' > 1 (with "
            "one microbatch in flight nothing waits between its forward and backward)",
            {"microbatches": values["microbatches"],
             "active_microbatches": values["active_microbatches"]}, where,
            "raise 'microbatches' (and 'active_microbatches') or drop 'offload_activations'")
    if "ddp_port" in given and not values["ddp"]:
        raise SMPConfigError.build("'ddp_port' requires 'ddp': true", values["ddp_port"],
                                   where, "set 'ddp': true, or drop 'ddp_port'")
    refused = combination_refusal(values, where)
    if refused is not None:
        raise refused
    return SMPConfig(**values, explicit=frozenset(given))


def combination_refusal(values: Mapping[str, Any], where: str = "smp.init"
                        ) -> SMPConfigError | None:
    """Why the runtime cannot run this combination of parallelisms and precisions (an
    error naming the nearest one it runs), or None: the one list of what is refused, read
    by ``smp.init`` and by the planner's ``--emit-config``. ``values``: parameter -> value;
    a missing one is its default. The world-size rules are ``resolve_topology``'s."""
    v = {**DEFAULTS, **values}
    tp, sdp = v["tensor_parallel_degree"], v["sharded_data_parallel_degree"]
    if tp > 1 and not v["ddp"]:
        return SMPConfigError.build("'tensor_parallel_degree' > 1 requires 'ddp': true", tp,
                                    where, "set 'ddp': true")
    if v["bf16"] and (v["fp16"] or v["fp16_params"]):
        return SMPConfigError.build("'bf16' and 'fp16' (or 'fp16_params') exclude each other",
                                    {"bf16": True, "fp16": v["fp16"],
                                     "fp16_params": v["fp16_params"]}, where,
                                    "enable one half-precision type")
    if v["shard_optimizer_state"] and not v["ddp"]:
        return SMPConfigError.build("'shard_optimizer_state' requires 'ddp': true", True,
                                    where, "set 'ddp': true (the state is sharded over the "
                                    "rdp group)")
    if sdp > 1 and not v["ddp"]:
        return SMPConfigError.build("'sharded_data_parallel_degree' > 1 requires 'ddp': true",
                                    sdp, where, "set 'ddp': true")
    cp = v["context_parallel_degree"]
    if cp > 1 and v["expert_parallel_degree"] > 1:
        return SMPConfigError.build(
            "'context_parallel_degree' > 1 with 'expert_parallel_degree' > 1 is not built "
            "(the ep groups are carved out of dp without a cp axis)",
            {"context_parallel_degree": cp,
             "expert_parallel_degree": v["expert_parallel_degree"]}, where,
            "set one of them to 1")
    pp = v["pipeline_parallel_degree"] or 1
    if cp > 1 and v["context_parallel_local_outputs"] and pp > 1:
        return SMPConfigError.build(
            "'context_parallel_local_outputs' with 'pipeline_parallel_degree' > 1 is not built "
            "(ranks without the last stage run their step functions beside the pipeline's cp "
            "collectives, which smp.cp_mean could meet in a different order on each cp rank)",
            {"context_parallel_local_outputs": True, "pipeline_parallel_degree": pp}, where,
            "compute the loss inside the model (a Hugging Face model given labels), or set "
            "pipeline_parallel_degree to 1")
    if sdp > 1 and v["shard_optimizer_state"]:
        return SMPConfigError.build(
            "'shard_optimizer_state' and 'sharded_data_parallel_degree' > 1 both shard the "
            "optimizer state", sdp, where,
            "drop 'shard_optimizer_state' (sharded data parallelism shards it already)")
    ep_refused = expert_parallel_refusal(v, where)
    if ep_refused is not None:
        return ep_refused
    if sdp > 1 and v["fp16_params"] and not v["fp16"]:
        return SMPConfigError.build(
            "'fp16_params' without 'fp16' leaves the optimizer to the script, which cannot "
            "step the shards of sharded data parallelism", sdp, where,
            "set 'fp16': true (smp-fx keeps fp32 master shards) or 'bf16': true")
    return None


def resolve_topology(config: SMPConfig, world_size: int) -> tuple[Topology, bool]:
    """(Topology, in_process) for ``world_size`` processes; the world-size rules live here.

    World must be divisible by pp x tp x cp (rdp = world / (pp x tp x cp)), except that a
    single process may run every pipeline stage itself (``in_process``; tp must then be 1).
    """
    pp, tp = config.pipeline_parallel_degree, config.tensor_parallel_degree
    cp = config.context_parallel_degree
    if cp > 1 and world_size % (pp * tp * cp) != 0:
        raise SMPConfigError.build(
            f"world size must be divisible by pipeline_parallel_degree x "
            f"tensor_parallel_degree x context_parallel_degree = {pp} x {tp} x {cp}",
            world_size, "smp.init",
            f"launch a multiple of {pp * tp * cp} processes, or lower context_parallel_degree")
    if world_size == 1 and pp > 1:
        if tp > 1:
            raise SMPConfigError.build(
                "a single process runs all pipeline stages in-process but cannot run "
                "tensor parallelism", tp, "tensor_parallel_degree",
                f"launch {pp * tp} (or a multiple) processes, e.g. smp-fx run -n {pp * tp}")
        _check_sdp_divides(config, 1, world_size, pp)
        check_ep_divides(config.expert_parallel_degree, 1, world_size, pp)
        return Topology(pp, 1, 1, config.placement), True
    if world_size % (pp * tp) != 0:
        raise SMPConfigError.build(
            f"world size must be divisible by pipeline_parallel_degree x "
            f"tensor_parallel_degree = {pp} x {tp}", world_size, "smp.init",
            f"launch a multiple of {pp * tp} processes, or 1 process for an in-process pipeline")
    rdp = world_size // (pp * tp * cp)
    _check_sdp_divides(config, rdp, world_size, pp * tp)
    check_ep_divides(config.expert_parallel_degree, rdp, world_size, pp * tp)
    return Topology(pp, tp, rdp, config.placement, cp), False


def validate(config: ConfigSource, world_size: int,
             env: Mapping[str, str] | None = None) -> tuple[SMPConfig, Topology, bool]:
    """Every check ``smp.init`` makes of ``config`` on ``world_size`` processes before it
    communicates (``load_config``, then ``resolve_topology``), without starting any: how
    the planner asks whether a plan runs. ``env`` defaults to no environment override.

    >>> validate({"pipeline_parallel_degree": 8, "ddp": True}, 3072)[1].rdp_size
    384
    """
    cfg = load_config(config, env={} if env is None else env)
    topology, in_process = resolve_topology(cfg, world_size)
    return cfg, topology, in_process


def _check_sdp_divides(config: SMPConfig, rdp: int, world_size: int, mp: int) -> None:
    """Sharded data parallelism shards over the rdp group (ranks of one tp shard)."""
    sdp = config.sharded_data_parallel_degree
    if sdp > 1 and rdp % sdp != 0:
        raise SMPConfigError.build(
            "'sharded_data_parallel_degree' must divide the reduced data-parallel degree "
            f"(world {world_size} / (pipeline x tensor parallel) {mp} = {rdp})", sdp,
            "sharded_data_parallel_degree",
            f"use a divisor of {rdp}, or launch more processes")


def _known(name: str) -> Param:
    if name not in BY_NAME:
        raise SMPConfigError.build("unknown configuration parameter", name,
                                   "SMPConfig.require_implemented", "see docs/parameters.md")
    return BY_NAME[name]


def parameter_table() -> str:
    """The Markdown table in docs/parameters.md (name, type, default, status, notes)."""
    rows = ["| parameter | type | default | status | notes |", "| --- | --- | --- | --- | --- |"]
    for p in PARAMS:
        default = {"pipeline_parallel_degree": "required", "memory_weight":
                   "0.2 if optimize is speed else 0.8", "active_microbatches":
                   "see notes"}.get(p.name, repr(p.default))
        kind = " / ".join(p.choices) if p.choices else p.kind.__name__
        rng = "" if p.minimum is None else f" >= {p.minimum}"
        rng += "" if p.maximum is None else f", <= {p.maximum}"
        notes = "; ".join(x for x in (p.doc, p.used_at and f"checked at {p.used_at}") if x)
        rows.append(f"| `{p.name}` | {kind}{rng} | {default} | {p.status} | {notes} |")
    for alias, target in ALIASES.items():
        rows.append(f"| `{alias}` | alias | | {IMPLEMENTED} | same as `{target}` |")
    for name in TENSORFLOW_ONLY:
        rows.append(f"| `{name}` | | | rejected | TensorFlow-only |")
    return "\n".join(rows)


_FIELDS = {f.name for f in dataclasses.fields(SMPConfig)} - {"explicit"}
assert _FIELDS == set(BY_NAME), "SMPConfig fields and PARAMS must list the same parameters"
