"""The predicted training step of one candidate: stages, schedule, collectives, optimizer.

Why one function: the search calls ``price`` for every candidate, and ``--fix`` with every
key given calls it once; both must give the same number. How a step is priced, as smp-fx's
runtime runs it:

1. **Stages** (``passes.cluster.stages``): the parts of ``passes.cluster.profile`` (head,
   layers, tail) cut into ``pp x vp`` contiguous chunks, the slowest minimised. A rank's
   forward, backward and weight-gradient time per microbatch are its chunks' sums, plus
   the runtime's cost per action and per message (``DeviceSpec.microbatch_overhead_s`` /
   ``message_overhead_s``), as the simulator charges them.
2. **Pipeline.** ``cost_model.schedule_cost.price_schedule`` gives the makespan and the
   bubble. Point-to-point messages carry a boundary's activations forward and its
   gradients back, the latter with the model's outputs (smp-fx hands them to every
   rank); a hop between nodes runs on one GPU's share of the node's network (SMP's
   ``cluster`` placement: tp ranks innermost, then pipeline stages, then data-parallel
   replicas). A rank whose messages take longer than its compute is link-bound.
3. **Data parallelism** (``cost_model.collectives``): the gradients are all-reduced over
   the dp group, started before each rank's last backward (DDP armed there, as
   ``smp_fx.dist.ddp`` does), so only what outlasts that backward is exposed, and at
   least the last 25 MiB bucket; ``zero1`` then broadcasts the updated parameters from
   their owners (an all-gather's worth); ``fsdp`` all-gathers each rank's parameters for
   every microbatch's forward and backward and reduce-scatters its gradients, overlapped
   with that microbatch's compute. Tied weights on two ranks sum their gradients.
4. **Optimizer**: ``DeviceSpec.optimizer_time`` over the rank's (sharded) fp32 state; the
   runtime's fixed cost per step.

The step ends with the last rank: rank r finishes its last backward ``r`` hops of drain
earlier than rank 0, which its exposed reduction may fill.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.cluster import ClusterSpec
from cost_model.collectives import Collective, collective_time, p2p_time
from cost_model.schedule_cost import RankTimes, in_flight_at, price_schedule
from passes.cluster.candidate import Candidate
from passes.cluster.memory import MemoryPerGPU, memory_per_gpu, state_bytes
from passes.cluster.profile import Profile
from passes.cluster.stages import Ranks

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""torch DDP's default ``bucket_cap_mb``: the last bucket's reduction is never hidden."""


@dataclass(frozen=True)
class Setting:
    """What a search holds fixed: the cluster, its size, the batch, the precision."""

    cluster: ClusterSpec
    gpus: int
    global_batch: int
    precision: str = "bf16"
    compute_factor: float = 1.0
    """How much slower ops run than the spec says (processes sharing a host's cores)."""


@dataclass(frozen=True)
class CommTimes:
    """Seconds per step on the slowest rank by kind; ``*_exposed``: not hidden by compute."""

    tp: float
    pp: float
    dp: float
    dp_exposed: float
    zero: float
    fsdp: float
    tied: float
    dp_algorithm: str = "none"

    def to_json(self) -> dict[str, object]:
        return {"tp_s": self.tp, "pp_s": self.pp, "dp_s": self.dp,
                "dp_exposed_s": self.dp_exposed, "zero_s": self.zero, "fsdp_s": self.fsdp,
                "tied_s": self.tied, "dp_algorithm": self.dp_algorithm}


@dataclass(frozen=True)
class Priced:
    """A candidate with its predicted step (module docstring) and memory."""

    candidate: Candidate
    microbatches: int
    step_time_s: float
    pipeline_s: float
    bubble_fraction: float
    optimizer_s: float
    comm: CommTimes
    memory: MemoryPerGPU
    memory_rank: int
    layers_per_rank: tuple[int, ...]
    hardware_flops: float
    """FLOPs every GPU executes in one step, summed (recompute and replicated work in)."""

    @property
    def memory_bytes(self) -> int:
        return self.memory.total


def dp_placement(c: Candidate, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, groups sharing each node's network) of one data-parallel group under SMP's
    ``cluster`` placement (tp innermost, then pp, then dp)."""
    inner = c.tp * c.pp
    per_node = max(1, gpus_per_node // inner) if inner < gpus_per_node else 1
    per_node = min(per_node, c.dp)
    nodes = max(1, c.dp // per_node)
    return nodes, max(1, min(gpus_per_node, c.gpus) // per_node)


def _crosses(c: Candidate, stage: int, gpus_per_node: int) -> bool:
    """Whether the hop from pipeline rank ``stage`` to the next crosses a node."""
    nxt = (stage + 1) % c.pp
    return (stage * c.tp) // gpus_per_node != (nxt * c.tp) // gpus_per_node


def _dp(kind: str, nbytes: float, c: Candidate, cluster: ClusterSpec) -> Collective:
    nodes, concurrent = dp_placement(c, cluster.gpus_per_node)
    return collective_time(kind, nbytes, c.dp, cluster.fabric(), nodes=nodes,
                           concurrent=concurrent)


def price(c: Candidate, ranks: Ranks, profile: Profile, setting: Setting) -> Priced:
    """The step of candidate ``c`` (module docstring); ``ranks`` is ``rank_loads`` of it."""
    cl, spec = setting.cluster, setting.cluster.device
    fabric = cl.fabric()
    m = c.microbatches(setting.global_batch)
    p, v = c.pp, c.vp
    s_bytes = state_bytes(setting.precision)
    # pipeline messages: one GPU's share of the links, hops in chunk order
    send_f = send_b = 0.0
    occupancy = [0.0] * p
    for i, (act, grad) in enumerate(ranks.hops):
        stage = i % p
        across = _crosses(c, stage, cl.gpus_per_node)
        tf, tb = p2p_time(act, fabric, across_nodes=across), p2p_time(grad, fabric,
                                                                       across_nodes=across)
        send_f, send_b = send_f + tf, send_b + tb
        occupancy[stage] += tf
        occupancy[(stage + 1) % p] += tb
    hop = (send_f + send_b) / (2 * len(ranks.hops)) if ranks.hops else 0.0
    times = []
    for r, t in enumerate(ranks.times):
        scale = occupancy[r] / t.total_s if t.total_s > 0 and occupancy[r] > t.total_s else 1.0
        times.append(RankTimes(t.fwd_s * scale, t.bwd_s * scale, t.wgrad_s * scale))
    sched = price_schedule(c.schedule, times, m, v, hop_s=hop)
    pipeline = sched.pipeline_s
    # data parallelism
    dp_s = zero_s = fsdp_s = tied_s = 0.0
    algorithm = "none"
    exposed = [0.0] * p
    fsdp_extra = 0.0
    for r in range(p):
        grad_bytes = ranks.elems[r] * s_bytes.reduce
        if c.dp > 1 and c.zero == "fsdp":
            gather = _dp("all_gather", ranks.elems[r] * s_bytes.param, c, cl).seconds
            scatter = _dp("reduce_scatter", grad_bytes, c, cl).seconds
            per_mb = 2 * gather + scatter
            fsdp_s = max(fsdp_s, m * per_mb)
            fsdp_extra = max(fsdp_extra, m * max(0.0, per_mb - times[r].total_s)
                             + gather / max(ranks.layers[r], 1))
        elif c.dp > 1:
            coll = _dp("all_reduce", grad_bytes, c, cl)
            algorithm = coll.algorithm
            window = times[r].bwd_s / v
            bucket = coll.seconds * min(1.0, DDP_BUCKET_BYTES / max(grad_bytes, 1))
            exposed[r] = max(coll.seconds - window, bucket)
            dp_s = max(dp_s, coll.seconds)
            if c.zero == "zero1":
                z = _dp("all_gather", ranks.elems[r] * s_bytes.param, c, cl).seconds
                zero_s = max(zero_s, z)
                exposed[r] += z
    for key, elems in {k: n for s in ranks.shared for k, n in s}.items():
        holders = sum(1 for s in ranks.shared if key in dict(s))
        if holders > 1:
            t = collective_time("all_reduce", elems * s_bytes.reduce, holders, fabric,
                                nodes=holders if c.pp * c.tp > cl.gpus_per_node else 1)
            tied_s = max(tied_s, t.seconds)
    pipeline += fsdp_extra
    opt = []
    shard = c.dp if c.zero != "none" and c.dp > 1 else 1
    for r in range(p):
        fp32_bytes = ranks.elems[r] * 4 / shard
        opt.append(spec.optimizer_time(max(1, ranks.tensors[r] // shard), fp32_bytes))
    drain = 0.0
    ends = []
    for r in range(p):
        ends.append(pipeline - drain + exposed[r] + tied_s + opt[r])
        drain += times[r].bwd_s / v + hop
    step = max(ends) + spec.step_overhead_s
    mems = memory_by_rank(c, ranks, profile, setting)
    mem_rank = max(range(p), key=lambda r: (mems[r].total, -r))
    tp_step = m * max(ranks.tp_s)
    pp_step = m * max(occupancy) if p > 1 else 0.0
    comm = CommTimes(tp_step, pp_step, dp_s, max(exposed), zero_s, fsdp_s, tied_s, algorithm)
    hw = sum(ranks.flops) * m * c.tp * c.dp
    return Priced(c, m, step, pipeline, sched.bubble_fraction, max(opt), comm, mems[mem_rank],
                  mem_rank, ranks.layers, hw)


def memory_by_rank(c: Candidate, ranks: Ranks, profile: Profile,
                   setting: Setting) -> list[MemoryPerGPU]:
    """Each pipeline rank's peak memory (``passes.cluster.memory``) under ``c``'s schedule."""
    m = c.microbatches(setting.global_batch)
    boundary = max((g for _, g in ranks.hops), default=0)
    return [memory_per_gpu(
        elems=ranks.elems[r], buffers=ranks.buffers[r], kept=ranks.kept[r],
        in_flight=in_flight_at(c.schedule, c.pp, m, c.vp, r), transient=ranks.transient[r],
        precision=setting.precision, zero=c.zero, dp=c.dp, layer_elems=ranks.layer_elems,
        boundary=boundary, output_bytes=profile.output_bytes, pipelined=c.pp > 1,
        tensors=ranks.tensors[r]) for r in range(c.pp)]


def model_flops(profile: Profile) -> float:
    """FLOPs of one microbatch through the whole model, forward and backward, no recompute
    (``profile`` at tensor-parallel degree 1)."""
    return sum(u.fwd_flops + u.bwd_flops for u in profile.units())


__all__ = ["DDP_BUCKET_BYTES", "CommTimes", "Priced", "Setting", "dp_placement",
           "memory_by_rank", "model_flops", "price"]
