"""Every configuration parameter: defaults, valid and invalid values, aliases, cross-field
rules, the environment override, unknown-key suggestions and the not-implemented table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cost_model.errors import SMPConfigError, SMPNotImplementedError
from passes.partition_config import PartitionConfig
from smp_fx.config import (
    BY_NAME,
    ENGINE,
    ENV_VAR,
    IMPLEMENTED,
    PARAMS,
    SMPConfig,
    combination_refusal,
    load_config,
    parameter_table,
    resolve_topology,
    validate,
)

BASE = {"pipeline_parallel_degree": 2}

# Defaults as the table of SMP's documentation gives them (written out, not read from the code).
DOC_DEFAULTS: dict[str, Any] = {
    "microbatches": 1, "pipeline": "interleaved", "optimize": "memory",
    "placement_strategy": "cluster", "auto_partition": True, "default_partition": 0,
    "memory_weight": 0.8, "ddp": False, "active_microbatches": 4,
    "deterministic_server": False, "offload_activations": False,
    "activation_loading_horizon": 4, "tensor_parallel_degree": 1, "fp16": False,
    "fp16_params": False, "shard_optimizer_state": False, "prescaled_batch": False,
    "skip_tracing": False, "sharded_data_parallel_degree": 1,
    "sdp_reduce_bucket_size": int(5e8), "sdp_param_persistence_threshold": int(1e6),
    "sdp_max_live_parameters": int(1e9), "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
}
# The parameters SMP 1.11-1.15 added (SMP's own configuration table of those releases).
LATER_DEFAULTS: dict[str, Any] = {
    "bf16": False, "delayed_parameter_initialization": False, "tensor_parallel_seed": 0,
    "static_mode": False, "fast_mode": False, "ddp_port": None, "ddp_dist_backend": "auto",
}
# Keys AWS's example notebooks and scripts write that SMP's parameter page does not list.
EXAMPLE_DEFAULTS: dict[str, Any] = {
    "checkpoint_attentions": False, "overlapping_allreduce": True, "_match_weights": False,
    "_fp32_grad_accumulation": False,
}

# name -> (valid values, invalid values); each checked alone on top of BASE (+ needs).
TABLE: dict[str, tuple[list[Any], list[Any]]] = {
    "pipeline_parallel_degree": ([1, 2, 8], [0, -1, 1.5, "2", True, None]),
    "microbatches": ([1, 4, 64], [0, -2, 2.5, "4", False]),
    "pipeline": (["interleaved", "simple", "zero_bubble"], ["gpipe", 1, None]),
    "virtual_pipeline_degree": ([1, 2, 4], [0, -1, 1.5, "2"]),
    "recompute_granularity": (["none", "selective"], ["full", True, None]),
    "compile": (["none", "inductor", "aot_eager"], [True, "max-autotune", None]),
    "expert_parallel_degree": ([1, 2, 8], [0, -1, 1.5, "2", True]),
    "context_parallel_degree": ([1, 2, 4], [0, -1, 1.5, "2"]),
    "context_parallel_local_outputs": ([True, False], ["yes", 1, None]),
    "async_checkpoint": ([True, False], ["yes", 1, None]),
    "optimize": (["memory", "speed"], ["fast", 0]),
    "placement_strategy": (["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"],
                           ["DP", "ring", 3]),
    "auto_partition": ([True, False], [1, "true", None]),
    "default_partition": ([0, 1], [-1, 2, 0.5, "0"]),
    "memory_weight": ([0.0, 0.5, 1.0, 1], [-0.1, 1.01, "0.5", True]),
    "ddp": ([True, False], [0, "yes"]),
    "active_microbatches": ([1, 2, 10], [0, -1, "3"]),
    "deterministic_server": ([True, False], [1]),
    "offload_activations": ([True, False], ["no"]),
    "activation_loading_horizon": ([1, 4, 8], [0, 2.2]),
    "tensor_parallel_degree": ([1, 2], [0, "2"]),
    "fp16": ([True, False], [1]),
    "fp16_params": ([True, False], [0]),
    "shard_optimizer_state": ([True, False], ["x"]),
    "prescaled_batch": ([True, False], [None]),
    "skip_tracing": ([True, False], [2]),
    "sharded_data_parallel_degree": ([1, 2], [0, "1"]),
    "sdp_reduce_bucket_size": ([1, 5e8, 100], [0, 1.5, "5e8"]),
    "sdp_param_persistence_threshold": ([0, 1e6], [-1, "x"]),
    "sdp_max_live_parameters": ([1, 1e9], [0, 0.5]),
    "sdp_hierarchical_allgather": ([True, False], [1]),
    "sdp_gradient_clipping": ([0.0, 1.0, 2], [-1.0, "1"]),
    "bf16": ([True, False], [1]),
    "delayed_parameter_initialization": ([True, False], ["yes"]),
    "tensor_parallel_seed": ([0, 7], [-1, 1.5]),
    "static_mode": ([True, False], [0]),
    "fast_mode": ([True, False], [None]),
    "ddp_port": ([0, 29501], [-1, "29501"]),
    "ddp_dist_backend": (["auto", "nccl"], ["smddp", 1]),
    "checkpoint_attentions": ([True, False], [1]),
    "overlapping_allreduce": ([True, False], ["true"]),
    "_match_weights": ([True, False], [0]),
    "_fp32_grad_accumulation": ([True, False], [None]),
}
NEEDS = {"tensor_parallel_degree": {"ddp": True}, "auto_partition": {"default_partition": 0},
         "ddp_port": {"ddp": True}, "expert_parallel_degree": {"ddp": True},
         "shard_optimizer_state": {"ddp": True}, "sharded_data_parallel_degree": {"ddp": True},
         "offload_activations": {"microbatches": 2},
         "virtual_pipeline_degree": {"microbatches": 4},
         "context_parallel_degree": {"pipeline_parallel_degree": 1}}
EXTENSIONS = {"virtual_pipeline_degree", "recompute_granularity", "compile",
              "expert_parallel_degree", "context_parallel_degree",
              "context_parallel_local_outputs", "async_checkpoint"}
"""smp-fx's own parameters: SMP's documentation has no such keys."""


def _load(cfg: Any, env: dict[str, str] | None = None) -> SMPConfig:
    return load_config(cfg, env=env or {})


def test_table_covers_every_parameter() -> None:
    assert set(TABLE) == set(BY_NAME) == (
        set(DOC_DEFAULTS) | set(LATER_DEFAULTS) | set(EXAMPLE_DEFAULTS)
        | {"pipeline_parallel_degree"} | EXTENSIONS)


def test_defaults_match_smps_documentation() -> None:
    cfg = _load(BASE)
    for name, value in {**DOC_DEFAULTS, **LATER_DEFAULTS, **EXAMPLE_DEFAULTS}.items():
        assert getattr(cfg, name) == value, name
        assert type(getattr(cfg, name)) is type(value), name


@pytest.mark.parametrize("name, value", [(n, v) for n, (ok, _) in TABLE.items() for v in ok])
def test_valid_values(name: str, value: Any) -> None:
    cfg = _load({**BASE, **NEEDS.get(name, {}), name: value})
    got = getattr(cfg, name)
    assert got == value
    assert name in cfg.explicit


@pytest.mark.parametrize("name, value", [(n, v) for n, (_, bad) in TABLE.items() for v in bad])
def test_invalid_values(name: str, value: Any) -> None:
    with pytest.raises(SMPConfigError, match=name):
        _load({**BASE, **NEEDS.get(name, {}), name: value})


def test_integral_floats_become_ints() -> None:
    cfg = _load({**BASE, "sdp_reduce_bucket_size": 5e8, "microbatches": 4.0})
    assert cfg.sdp_reduce_bucket_size == 500_000_000 and type(cfg.microbatches) is int


def test_pipeline_degree_is_required() -> None:
    with pytest.raises(SMPConfigError, match="required"):
        _load({"microbatches": 2})
    with pytest.raises(SMPConfigError, match="required"):
        _load(None)


def test_partitions_alias() -> None:
    assert _load({"partitions": 3}).pipeline_parallel_degree == 3
    assert _load({"partitions": 3}).partitions == 3
    assert _load({"partitions": 2, "pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2
    with pytest.raises(SMPConfigError, match="disagree"):
        _load({"partitions": 2, "pipeline_parallel_degree": 4})


@pytest.mark.parametrize("optimize, weight", [("speed", 0.2), ("memory", 0.8)])
def test_memory_weight_default_follows_optimize(optimize: str, weight: float) -> None:
    assert _load({**BASE, "optimize": optimize}).memory_weight == weight
    assert _load({**BASE, "optimize": optimize, "memory_weight": 0.5}).memory_weight == 0.5


def test_active_microbatches_default_is_partitions_plus_two() -> None:
    assert _load({"partitions": 4}).active_microbatches == 6


def test_cross_field_rules() -> None:
    with pytest.raises(SMPConfigError, match="requires 'ddp'"):
        _load({**BASE, "tensor_parallel_degree": 2})
    with pytest.raises(SMPConfigError, match="requires 'default_partition'"):
        _load({**BASE, "auto_partition": False})
    assert _load({**BASE, "auto_partition": False, "default_partition": 1}).default_partition == 1
    with pytest.raises(SMPConfigError, match="default_partition"):
        _load({**BASE, "default_partition": 2})
    with pytest.raises(SMPConfigError, match="'sharded_data_parallel_degree' > 1 requires"):
        _load({**BASE, "sharded_data_parallel_degree": 2})
    with pytest.raises(SMPConfigError, match="'shard_optimizer_state' requires 'ddp'"):
        _load({**BASE, "shard_optimizer_state": True})
    sharded = {**BASE, "ddp": True, "sharded_data_parallel_degree": 2}
    assert _load(sharded).sharded_data_parallel_degree == 2
    with pytest.raises(SMPConfigError, match="both shard the optimizer state"):
        _load({**sharded, "shard_optimizer_state": True})
    assert _load({**sharded, "fp16": True}).fp16  # fp16 shards, fp32 master shards
    assert _load({**sharded, "bf16": True}).bf16
    assert _load({**sharded, "tensor_parallel_degree": 2, "fp16": True}).fp16
    assert _load({**BASE, "ddp": True, "shard_optimizer_state": True,
                  "tensor_parallel_degree": 2}).shard_optimizer_state
    with pytest.raises(SMPConfigError, match="set 'fp16': true"):
        _load({**sharded, "fp16_params": True})
    with pytest.raises(SMPConfigError, match="'bf16' and 'fp16'"):
        _load({**BASE, "bf16": True, "fp16": True})
    with pytest.raises(SMPConfigError, match="'ddp_port' requires 'ddp'"):
        _load({**BASE, "ddp_port": 29501})


def test_engine_tuning_parameters_are_accepted_at_any_value() -> None:
    """What the script of AWS's GPT-2 example passes, False included, and the rest of SMP's
    engine switches: accepted, never an error where a feature is used."""
    given = {"static_mode": True, "fast_mode": True, "ddp": True, "ddp_port": 29501,
             "ddp_dist_backend": "nccl", "delayed_parameter_initialization": True}
    cfg = _load({**BASE, **given})
    assert all(getattr(cfg, k) == v for k, v in given.items())
    for p in PARAMS:
        if p.status == ENGINE:
            cfg.require_implemented(p.name)
    off = _load({**BASE, "bf16": False, "static_mode": False, "fast_mode": False,
                 "delayed_parameter_initialization": False})
    off.check_features("DistributedModel")


@pytest.mark.parametrize("world, pp, tp, rdp, in_process", [
    (8, 2, 2, 2, False), (4, 2, 1, 2, False), (1, 1, 1, 1, False), (1, 4, 1, 1, True),
    (6, 3, 1, 2, False)])
def test_world_size_rules(world: int, pp: int, tp: int, rdp: int, in_process: bool) -> None:
    cfg = _load({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "ddp": True})
    topo, inproc = resolve_topology(cfg, world)
    assert (topo.pp_size, topo.tp_size, topo.rdp_size, inproc) == (pp, tp, rdp, in_process)


@pytest.mark.parametrize("given", [
    {"tensor_parallel_degree": 2}, {"bf16": True, "fp16": True},
    {"shard_optimizer_state": True}, {"sharded_data_parallel_degree": 2},
    {"ddp": True, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
    {"ddp": True, "sharded_data_parallel_degree": 2, "fp16_params": True}])
def test_every_refused_combination_is_one_config_error_naming_a_fix(
        given: dict[str, Any]) -> None:
    """``combination_refusal`` (what ``smp.init`` and the planner ask) says why, as the
    SMPConfigError ``smp.init`` raises, with a fix that names what would run."""
    why = combination_refusal(given)
    assert isinstance(why, SMPConfigError) and "Fix: " in str(why)
    fixed = {**given, "ddp": True, "fp16": not given.get("bf16") and given.get("fp16", False),
             "shard_optimizer_state": given.get("shard_optimizer_state", False)
             and "sharded_data_parallel_degree" not in given,
             "fp16_params": False}
    assert combination_refusal(fixed) is None
    with pytest.raises(SMPConfigError) as raised:
        _load({**BASE, **given})
    assert str(raised.value) == str(why).replace("smp.init", "the smp configuration")


@pytest.mark.parametrize("world, tp, sdp, ok", [(8, 2, 2, True), (8, 2, 4, True),
                                               (8, 4, 4, False), (4, 2, 4, False)])
def test_sdp_divides_the_reduced_data_parallel_degree(world: int, tp: int, sdp: int,
                                                       ok: bool) -> None:
    """Sharded data parallelism shards over the rdp group (world / (pp x tp) at pp 1)."""
    cfg = _load({"pipeline_parallel_degree": 1, "tensor_parallel_degree": tp, "ddp": True,
                 "sharded_data_parallel_degree": sdp})
    if ok:
        assert resolve_topology(cfg, world)[0].rdp_size % sdp == 0
    else:
        with pytest.raises(SMPConfigError, match="reduced data-parallel degree"):
            resolve_topology(cfg, world)


@pytest.mark.parametrize("world, pp, tp", [(3, 2, 1), (4, 2, 4), (2, 4, 1), (1, 2, 2)])
def test_world_size_not_divisible(world: int, pp: int, tp: int) -> None:
    cfg = _load({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "ddp": True})
    with pytest.raises(SMPConfigError, match="world size|tensor parallelism"):
        resolve_topology(cfg, world)


def test_validate_is_smp_init_s_checks_on_a_world_size() -> None:
    """Both halves, on a world no test could start: the parameters, then the world size;
    the environment override is left out unless given."""
    cfg, topo, _ = validate({"pipeline_parallel_degree": 8, "tensor_parallel_degree": 8,
                             "ddp": True, "microbatches": 24}, 3072,
                            env={ENV_VAR: '{"microbatches": 48}'})
    assert (topo.rdp_size, cfg.microbatches) == (48, 48)
    with pytest.raises(SMPConfigError, match="world size"):
        validate({"pipeline_parallel_degree": 7, "ddp": True}, 3072)
    with pytest.raises(SMPConfigError, match="must divide"):
        validate({"pipeline_parallel_degree": 8, "ddp": True,
                  "sharded_data_parallel_degree": 5}, 3072)


@pytest.mark.parametrize("key, suggestion", [
    ("microbatch", "microbatches"), ("pipeline_parallel_degre", "pipeline_parallel_degree"),
    ("memory_wieght", "memory_weight"), ("partition", "partitions")])
def test_unknown_key_suggests_closest(key: str, suggestion: str) -> None:
    with pytest.raises(SMPConfigError, match=f"did you mean '{suggestion}'"):
        _load({**BASE, key: 1})


@pytest.mark.parametrize("key", ["contiguous", "horovod"])
def test_tensorflow_only_rejected(key: str) -> None:
    with pytest.raises(SMPConfigError, match="TensorFlow-only"):
        _load({**BASE, key: True})


def test_env_overrides_dict_and_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"partitions": 2, "microbatches": 4}))
    env = {ENV_VAR: json.dumps({"pipeline_parallel_degree": 4, "pipeline": "simple"})}
    cfg = _load(str(path), env)
    assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.pipeline) == (4, 4, "simple")
    assert _load(path).microbatches == 4
    with pytest.raises(SMPConfigError, match="JSON"):
        _load(BASE, {ENV_VAR: "{not json"})
    with pytest.raises(SMPConfigError, match=ENV_VAR):
        _load(BASE, {ENV_VAR: json.dumps({"microbatchez": 2})})
    with pytest.raises(SMPConfigError, match="not found"):
        _load(str(tmp_path / "missing.json"))
    with pytest.raises(SMPConfigError, match="dict"):
        _load(42)


@pytest.mark.parametrize("name", [p.name for p in PARAMS if p.status not in (IMPLEMENTED, ENGINE)
                                  and p.name != "sharded_data_parallel_degree"])
def test_unimplemented_fail_at_point_of_use(name: str) -> None:
    param = BY_NAME[name]
    value = TABLE[name][0][-1] if TABLE[name][0][-1] != param.default else TABLE[name][0][0]
    if param.kind is bool:
        value = not param.default
    cfg = _load({**BASE, **NEEDS.get(name, {}), name: value})
    _load(BASE).require_implemented(name)  # default: fine
    with pytest.raises(SMPNotImplementedError, match=name):
        cfg.require_implemented(name)
    with pytest.raises(SMPNotImplementedError, match=name):
        cfg.check_features(param.used_at)


def test_keys_the_examples_write_are_accepted() -> None:
    """What AWS's GPT-Neo / GPT-2-custom / BERT notebooks pass besides SMP's documented keys:
    accepted; the engine switch at any value, the planned one at its default."""
    given = {"checkpoint_attentions": True, "_match_weights": True,
             "_fp32_grad_accumulation": False, "overlapping_allreduce": False}
    cfg = _load({**BASE, **given})
    assert all(getattr(cfg, k) == v for k, v in given.items())
    cfg.check_features("DistributedModel")
    assert BY_NAME["_match_weights"].status == ENGINE
    with pytest.raises(SMPNotImplementedError, match="_fp32_grad_accumulation"):
        _load({**BASE, "_fp32_grad_accumulation": True}).check_features("DistributedModel")


def test_implemented_never_raise_and_json_round_trip() -> None:
    cfg = _load({**BASE, "ddp": True, "microbatches": 4, "placement_strategy": "PTD"})
    for p in PARAMS:
        if p.status == IMPLEMENTED:
            cfg.require_implemented(p.name)
    back = SMPConfig.from_json(cfg.to_json())
    assert back == cfg and back.explicit == cfg.explicit
    assert _load(cfg) == cfg  # an SMPConfig is a valid source
    assert cfg.placement == "PTD"


def test_parameter_table_lists_everything() -> None:
    text = parameter_table()
    for p in PARAMS:
        assert f"`{p.name}`" in text
    assert "`partitions`" in text and "TensorFlow-only" in text
    root = Path(__file__).resolve().parents[2]
    for doc in ("docs/parameters.md",):
        assert text in (root / doc).read_text(), f"{doc}'s parameter table is stale: regenerate it"


def test_offloading_needs_several_microbatches_in_flight() -> None:
    for extra in ({"microbatches": 1}, {"microbatches": 4, "active_microbatches": 1}):
        with pytest.raises(SMPConfigError, match="offload_activations.*microbatches"):
            _load({**BASE, "offload_activations": True, **extra})


def test_schedule_combinations_that_cannot_run_say_what_would() -> None:
    with pytest.raises(SMPConfigError, match=r"multiple of it \(got 6\).*set microbatches "
                       r"to 4 or 8"):
        _load({"pipeline_parallel_degree": 4, "microbatches": 6, "virtual_pipeline_degree": 2})
    with pytest.raises(SMPConfigError, match="zbv.*exactly two chunks.*set virtual_pipeline"):
        _load({**BASE, "microbatches": 4, "pipeline": "zbv"})
    with pytest.raises(SMPConfigError, match="holds 4 microbatches.*>= 4"):
        _load({**BASE, "microbatches": 4, "pipeline": "zbv", "virtual_pipeline_degree": 2,
               "active_microbatches": 2})
    # looped BFS takes any microbatch count; zbv any at v = 2
    _load({**BASE, "microbatches": 3, "pipeline": "simple", "virtual_pipeline_degree": 3})
    _load({**BASE, "microbatches": 3, "pipeline": "zbv", "virtual_pipeline_degree": 2})


def test_active_microbatches_default_follows_the_schedule() -> None:
    # SMP's p + 2 where a cap shortens the warm-up; no cap (= microbatches) where the
    # interleaved order or the V fixes it
    assert _load({**BASE, "microbatches": 8}).active_microbatches == 4
    assert _load({**BASE, "microbatches": 8, "pipeline": "zero_bubble"}).active_microbatches == 4
    assert _load({**BASE, "microbatches": 8, "virtual_pipeline_degree": 2,
                  "pipeline": "simple"}).active_microbatches == 4
    for pipe in ("interleaved", "zero_bubble", "zbv"):
        cfg = _load({**BASE, "microbatches": 8, "virtual_pipeline_degree": 2, "pipeline": pipe})
        assert cfg.active_microbatches == 8
        assert cfg.partition_config().virtual_stages == 2


def test_context_parallel_divides_the_world_and_composes_but_not_with_ep() -> None:
    cfg = _load({"pipeline_parallel_degree": 1, "context_parallel_degree": 2, "ddp": True})
    topo, _ = resolve_topology(cfg, 8)
    assert (topo.cp_size, topo.rdp_size, topo.group("cp", 5)) == (2, 4, [4, 5])
    with pytest.raises(SMPConfigError, match="multiple of 4 processes") as err:
        resolve_topology(_load({"pipeline_parallel_degree": 1, "context_parallel_degree": 4}),
                         6)
    assert "\n" not in str(err.value)
    for other in ({"pipeline_parallel_degree": 2}, {"tensor_parallel_degree": 2, "ddp": True},
                  {"sharded_data_parallel_degree": 2, "ddp": True}):
        _load({"pipeline_parallel_degree": 1, "context_parallel_degree": 2, **other})
    for other in ({"expert_parallel_degree": 2, "ddp": True},):
        with pytest.raises(SMPConfigError, match="context_parallel_degree"):
            _load({"pipeline_parallel_degree": 1, "context_parallel_degree": 2, **other})


def test_local_outputs_are_refused_with_a_pipeline_and_accepted_without() -> None:
    local = {"context_parallel_degree": 2, "context_parallel_local_outputs": True}
    _load({"pipeline_parallel_degree": 1, **local})
    _load({"pipeline_parallel_degree": 2, "context_parallel_local_outputs": True})  # cp 1
    with pytest.raises(SMPConfigError, match="local_outputs.*loss inside the model") as err:
        _load({"pipeline_parallel_degree": 2, **local})
    assert "\n" not in str(err.value)


def test_partition_config_carries_the_state_model() -> None:
    """The precision flags and the sharding reach the plan's state count (cost_model.memory)."""
    base = {"pipeline_parallel_degree": 2, "ddp": True}
    cases = [({}, "fp32", "none", 4), ({"fp16": True}, "fp16", "none", 4),
             ({"bf16": True}, "bf16_params", "none", 4),
             ({"fp16": True, "shard_optimizer_state": True}, "fp16", "zero1", 4),
             ({"sharded_data_parallel_degree": 2}, "fp32", "fsdp", 2)]
    for extra, precision, zero, dp in cases:
        pc = load_config({**base, **extra}, env={}).partition_config(data_parallel_degree=4)
        assert (pc.precision, pc.zero, pc.data_parallel_degree) == (precision, zero, dp)
        assert PartitionConfig.from_json(pc.to_json()) == pc
    plain = load_config(base, env={}).partition_config().to_json()
    assert "precision" not in plain and "zero" not in plain  # plans without them read as before
    with pytest.raises(SMPConfigError, match="precision"):
        PartitionConfig(num_stages=2, precision="fp8")
