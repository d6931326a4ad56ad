"""``smp.init``: validate the configuration, join the job, build every process group.

Order matters: everything that can reject the configuration (parameters, the world-size
rules, the backend) runs first, on every rank, from local facts only. Only then does the
process touch the network, so a bad configuration fails on all ranks alike instead of
leaving some of them blocked in a rendezvous.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from cost_model.errors import SMPConfigError, SMPRuntimeError
from smp_fx.config import ConfigSource, SMPConfig, load_config, resolve_topology
from smp_fx.world import elastic, expert_groups, launch, order_mode, reports, state

log = logging.getLogger(__name__)


def init(config: ConfigSource = None, backend: str | None = None) -> None:
    """Initialise smp-fx in this process (call once, on every rank, before other smp calls).

    ``config`` is a dict of SMP parameters, a path to a JSON file with one, or None;
    values in ``SM_HP_MP_PARAMETERS`` override it. ``backend`` (or ``SMP_FX_BACKEND``)
    picks gloo or nccl; the default is nccl when CUDA is available.

    >>> import smp_fx as smp
    >>> smp.init({"pipeline_parallel_degree": 1})
    >>> smp.rank(), smp.size()
    (0, 1)
    """
    cfg = load_config(config)
    info = launch.detect()
    cfg, elastic_note = elastic.adjust(cfg, info.world_size)  # a node range's restart
    topology, in_process = resolve_topology(cfg, info.world_size)
    if info.launcher == "existing":
        chosen = str(dist.get_backend())
        if backend is not None and backend.lower() != chosen:
            raise SMPConfigError.build(
                "torch.distributed is already initialised with another backend",
                {"requested": backend, "existing": chosen}, "smp.init(backend=...)",
                "drop backend= to reuse the existing process group")
    else:
        chosen = launch.choose_backend(backend)
    if state.is_initialized():
        _check_same(state.get().config, cfg)
        return
    if cfg.ddp is False and topology.rdp_size > 1:
        warnings.warn(f"{topology.rdp_size} model replicas but 'ddp' is false: smp-fx will not "
                      "average gradients across them; set 'ddp': true for data parallelism",
                      stacklevel=2)
    wait = launch.timeout()
    owns = launch.join(info, chosen, wait)
    groups, objects, created = state.build_groups(topology, info.rank, chosen, in_process,
                                                  wait)
    created += expert_groups.build(cfg.expert_parallel_degree, topology, info.rank, chosen,
                                   in_process, wait, groups, objects)
    device = (torch.device("cuda", info.local_rank % max(torch.cuda.device_count(), 1))
              if torch.cuda.is_available() else torch.device("cpu"))
    state._set(state.State(config=cfg, topology=topology, launch=info, backend=chosen,
                           device=device, in_process=in_process, owns_default_group=owns,
                           groups=groups, object_groups=objects, created=created))
    if order_mode.enabled() and not in_process and topology.world_size > 1:
        order_mode.install(wait, groups, objects)
        if cfg.compile != "none" and info.rank == 0:
            log.warning(order_mode.COMPILED)
    for line in (elastic_note, elastic.shared_store_advice()):
        if line and info.rank == 0:
            log.warning(line)
    stage = state.get().axis_rank("pp")
    reports.started(info.rank, stage)  # under smp-fx run: which rank failed first
    reports.install_excepthook(info.rank, stage)


def _check_same(current: SMPConfig, new: SMPConfig) -> None:
    if current != new:
        changed = {k: (v, getattr(new, k)) for k, v in current.values().items()
                   if getattr(new, k) != v}
        raise SMPRuntimeError.build(
            "smp.init() was already called with a different configuration", changed,
            "smp.init", "call smp.init once per process (tests: smp_fx.world.state._reset())")


def is_initialized() -> bool:
    """True once ``smp.init`` has run in this process."""
    return state.is_initialized()
