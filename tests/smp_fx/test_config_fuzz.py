"""Fuzzed configurations: every input to ``load_config`` and ``resolve_topology`` is either
accepted or an ``SMPError`` (never a raw exception), and well-formed ones are accepted.

Both functions run on every rank before any collective (``smp.init``), so this is also the
guarantee that a bad configuration cannot hang a job. ``SMP_FX_FUZZ_EXAMPLES`` raises the
number of examples (default 150 each, about a second).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from smp_fx import SMPError
from smp_fx.config import PARAMS, SMPConfig, load_config, resolve_topology

EXAMPLES = int(os.environ.get("SMP_FX_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

ANYTHING = hs.one_of(hs.none(), hs.booleans(), hs.integers(-3, 70), hs.floats(allow_nan=True),
                     hs.text(max_size=12), hs.lists(hs.integers(0, 3), max_size=3),
                     hs.dictionaries(hs.text(max_size=4), hs.integers(), max_size=2))


def _value(kind: type, choices: tuple[str, ...]) -> hs.SearchStrategy[Any]:
    """Values near the edge of what a parameter of this kind takes, and wrong kinds."""
    if choices:
        return hs.one_of(hs.sampled_from(choices), ANYTHING)
    if kind is bool:
        return hs.one_of(hs.booleans(), ANYTHING)
    if kind is int:
        return hs.one_of(hs.integers(-2, 9), ANYTHING)
    if kind is float:
        return hs.one_of(hs.floats(-0.5, 1.5), ANYTHING)
    return ANYTHING


VALID = hs.fixed_dictionaries(
    {"partitions": hs.integers(1, 8)},
    optional={"microbatches": hs.integers(1, 64),
              "pipeline": hs.sampled_from(("interleaved", "simple")),
              "optimize": hs.sampled_from(("memory", "speed")),
              "placement_strategy": hs.sampled_from(("cluster", "spread")),
              "memory_weight": hs.floats(0.0, 1.0),
              "active_microbatches": hs.integers(1, 16),
              "ddp": hs.booleans(),
              "deterministic_server": hs.booleans(),
              "activation_loading_horizon": hs.integers(1, 8)})

NAMES = [p.name for p in PARAMS] + ["partitions", "horovod", "no_such_parameter"]
RAW = hs.dictionaries(hs.sampled_from(NAMES), ANYTHING, max_size=6)
TYPED = hs.fixed_dictionaries(
    {}, optional={p.name: _value(p.kind, p.choices) for p in PARAMS})
#: a well-formed configuration with a few parameters changed to anything: mostly near misses
MUTATED = hs.tuples(VALID, hs.one_of(RAW, TYPED).map(lambda d: dict(list(d.items())[:2]))).map(
    lambda pair: {**pair[0], **pair[1]})


@FUZZ
@given(config=hs.one_of(MUTATED, RAW, TYPED, ANYTHING), world=hs.integers(0, 17))
def test_any_configuration_is_accepted_or_an_smp_error(config: Any, world: int) -> None:
    try:
        cfg = load_config(config, env={})
    except SMPError:
        return
    assert isinstance(cfg, SMPConfig)
    try:
        topology, _ = resolve_topology(cfg, world)
    except SMPError:
        return
    assert topology.pp_size == cfg.pipeline_parallel_degree


@FUZZ
@given(config=VALID, replicas=hs.integers(1, 3))
def test_well_formed_configurations_are_accepted(config: dict[str, Any], replicas: int) -> None:
    cfg = load_config(config, env={})
    assert cfg.pipeline_parallel_degree == config["partitions"]
    for name in set(config) - {"partitions"}:
        assert getattr(cfg, name) == config[name], name
    topology, in_process = resolve_topology(cfg, cfg.pipeline_parallel_degree * replicas)
    assert (topology.pp_size, topology.rdp_size, in_process) == (
        cfg.pipeline_parallel_degree, replicas, False)
