"""The predicted training step of one candidate: stages, schedule, collectives, optimizer.

Why one function: the search calls ``price`` for every candidate, and ``--fix`` with every
key given calls it once; both must give the same number. How a step is priced, as smp-fx's
runtime runs it:

1. **Stages** (``smp_fx.planner.stages``): the parts of ``smp_fx.planner.profile`` (head,
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
   ``smp_fx.parallel.ddp`` does), so only what outlasts that backward is exposed, and at
   least the last 25 MiB bucket; ``zero1`` then broadcasts the updated parameters from
   their owners (an all-gather's worth); ``fsdp`` all-gathers each rank's parameters for
   every microbatch's forward and backward and reduce-scatters its gradients, overlapped
   with that microbatch's compute, and all-reduces the tensors it keeps whole (below
   ``sdp_param_persistence_threshold``) after the step. Tied weights on two ranks sum
   their gradients.
4. **Expert and context parallelism** (``smp_fx.planner.exchange``): each MoE block
   dispatches its tokens' picks to their experts' ranks and combines them back, an
   all-to-all each way in the forward and two more in the backward, on the links the ep
   group spans (ep consecutive dp ranks); each attention all-gathers its keys and values
   over the cp group (tp GPUs apart) in the forward and reduce-scatters their gradients
   in the backward (the gathered keys and values stay saved for the backward unless the
   layer is recomputed whole). Both are added to the rank's compute (not overlapped); a
   cp rank computes 1/cp of each microbatch at the efficiency of the whole one
   (optimistic for short sequences, where smaller matmuls run slower), and the gradients
   are reduced over cp x dp ranks. A rank reduces, gathers and steps its 1/ep of the
   experts (``held_elems``), priced over all of dp (they reduce over dp / ep ranks: an
   upper bound); under ``fsdp`` they are sharded over those ranks too, gathered and
   reduce-scattered once per microbatch, not hidden (the runtime's root unit).
   Each group is priced where the worst one of the layout runs
   (``smp_fx.planner.placement``: uneven spans over nodes included).
5. **Optimizer**: ``DeviceSpec.optimizer_time`` over the rank's (sharded) fp32 state; the
   runtime's fixed cost per step.

The step ends with the last rank: rank r finishes its last backward ``r`` hops of drain
earlier than rank 0, which its exposed reduction may fill.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cost_model.cluster import ClusterSpec
from cost_model.collectives import Collective, Fabric, collective_time, p2p_time
from cost_model.errors import SMPConfigError
from cost_model.memory import MemoryPerGPU, memory_per_gpu, state_bytes
from cost_model.schedule_cost import RankTimes, ScheduleCost, in_flight_at, price_schedule
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.expert_gemm import ep_change
from smp_fx.planner.megatron_loss import loss_times
from smp_fx.planner.overlap import (
    MEGATRON_CORE,
    SMP_FX,
    hide_tp,
    megatron_bucket_elems,
    megatron_logits,
    megatron_memory,
    megatron_precision,
    overlapped,
)
from smp_fx.planner.placement import megatron_expert_span, span
from smp_fx.planner.profile import Profile
from smp_fx.planner.stages import Ranks, chunk_ranks

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
    step_temporary: bool = False
    """The optimizer step makes a float32 temporary of the parameters it steps (torch's
    Adam on CUDA, ``foreach``; ``cost_model.memory``)."""
    runtime: str = "smp-fx"
    """Whose overlaps price the step: smp-fx's, or ``"megatron-core"``'s
    (``smp_fx.planner.overlap``), to price runs published with Megatron-Core; or
    ``"megatron-lm"`` (smp-fx's, with Megatron's sequence-parallel activations) for runs
    published with Megatron-LM (``overlap.MEGATRON_LM``)."""
    cp_local_outputs: bool = False
    """Under cp the outputs stay each rank's tokens (a loss inside the model, or
    ``context_parallel_local_outputs``): 1/cp of them held (``cost_model.memory``)."""
    megatron_grads: str = "fp32"
    """Under ``"megatron-core"`` at bf16: the gradients' buffer and reduction dtype
    (``smp_fx.planner.overlap.GRADS``)."""
    fp8: bool = False
    """The repeated layers' linears do their GEMMs in FP8, as Transformer Engine's FP8
    recipes run them (``passes.fp8_linears``); the weights, activations and state stay
    in ``precision``, beside the weights' FP8 copies (``fp8_weights``)."""
    fp8_params: bool = False
    """With ``fp8``: the layers' weights kept in FP8 alone (Transformer Engine's FP8
    parameters, NeMo's ``fp8_params``), their copy in ``precision`` not held."""
    split_ends: bool = False
    """Under ``"megatron-core"``: its even layer split counts the embedding and the loss
    as a layer each (``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split``; ``smp_fx.planner.stages.even_counts``)."""

    def __post_init__(self) -> None:
        if self.fp8_params and not self.fp8:
            raise SMPConfigError.build(
                "FP8 parameters are the weights of FP8 linears", "fp8_params without fp8",
                "Setting", "set fp8 too (smp-fx plan --fp8 --fp8-params)")
        if self.split_ends and self.runtime != MEGATRON_CORE:
            raise SMPConfigError.build(
                "the embedding and the loss are counted as layers by Megatron-Core's split",
                f"split_ends with runtime {self.runtime!r}", "Setting",
                "price the run as runtime 'megatron-core', or leave split_ends off "
                "(smp-fx's runtime splits by cost)")

    @functools.cached_property
    def fabric(self) -> Fabric:
        """The cluster's links at NCCL's bandwidth (computed once per setting)."""
        return self.cluster.fabric()


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
    fsdp_exposed: float = 0.0
    ep: float = 0.0
    cp: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {"tp_s": self.tp, "pp_s": self.pp, "dp_s": self.dp,
                "dp_exposed_s": self.dp_exposed, "zero_s": self.zero, "fsdp_s": self.fsdp,
                "fsdp_exposed_s": self.fsdp_exposed, "tied_s": self.tied,
                "dp_algorithm": self.dp_algorithm, "ep_s": self.ep, "cp_s": self.cp}


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


def exchange_times(c: Candidate, ranks: Ranks, fabric: Fabric, runtime: str = SMP_FX
                   ) -> tuple[list[float], list[float]]:
    """Per pipeline rank, the seconds per microbatch of expert parallelism's all-to-alls
    (over the ep groups of ``runtime``'s layout) and of context parallelism's K/V
    exchange (module docstring, 4)."""
    gpn = fabric.gpus_per_node
    ep_s, cp_s = [0.0] * c.pp, [0.0] * c.pp
    if c.ep > 1 and ranks.dispatch:
        nodes, concurrent = (megatron_expert_span(c, "ep", gpn) if runtime == MEGATRON_CORE
                             else span(c, "ep", gpn))
        for r, nbytes in enumerate(ranks.dispatch):
            one = collective_time("all_to_all", nbytes, c.ep, fabric, nodes=nodes,
                                  concurrent=concurrent)
            ep_s[r] = 4 * one.seconds
    if c.cp > 1 and ranks.kv:
        nodes, concurrent = span(c, "cp", gpn)
        for r, nbytes in enumerate(ranks.kv):
            cp_s[r] = sum(collective_time(kind, nbytes, c.cp, fabric, nodes=nodes,
                                          concurrent=concurrent).seconds
                          for kind in ("all_gather", "reduce_scatter"))
    return ep_s, cp_s


def crosses_node(c: Candidate, stage: int, gpus_per_node: int) -> bool:
    """Whether the hop from pipeline rank ``stage`` to the next crosses a node."""
    nxt = (stage + 1) % c.pp
    return (stage * c.tp) // gpus_per_node != (nxt * c.tp) // gpus_per_node


@dataclass(frozen=True)
class Links:
    """What the pipeline's messages do to one set of rank loads (``links``): the ranks'
    times (a link-bound rank runs at its messages' pace), one hop, each rank's link
    occupancy per microbatch, and the loads as arrays for the per-candidate sums."""

    times: tuple[RankTimes, ...]
    hop_s: float
    occupancy: tuple[float, ...]
    bwd: np.ndarray
    total: np.ndarray
    elems: np.ndarray
    tensors: np.ndarray
    layers: np.ndarray
    boundary: int


def links(c: Candidate, ranks: Ranks, setting: Setting) -> Links:
    """The pipeline messages of ``ranks`` at ``c``'s tp and pp (module docstring, 2); the
    same for every candidate sharing them, so the search computes it once."""
    p, gpn, fabric = c.pp, setting.cluster.gpus_per_node, setting.fabric
    send_f = send_b = 0.0
    occupancy = [0.0] * p
    sends: dict[tuple[int, bool], float] = {}
    for i, (act, grad) in enumerate(ranks.hops):
        if setting.runtime == MEGATRON_CORE:
            grad = act  # the loss stays on the last stage: no outputs travel back
        stage = i % p
        across = crosses_node(c, stage, gpn)
        for nbytes in (act, grad):
            if (nbytes, across) not in sends:
                sends[(nbytes, across)] = p2p_time(nbytes, fabric, across_nodes=across)
        tf, tb = sends[(act, across)], sends[(grad, across)]
        send_f, send_b = send_f + tf, send_b + tb
        occupancy[stage] += tf
        occupancy[(stage + 1) % p] += tb
    hop = (send_f + send_b) / (2 * len(ranks.hops)) if ranks.hops else 0.0
    times = []
    base = ranks.times if setting.runtime != MEGATRON_CORE else _with_loss(
        hide_tp(ranks.times, ranks.tp_s), c, ranks, setting)
    for r, t in enumerate(base):
        scale = occupancy[r] / t.total_s if t.total_s > 0 and occupancy[r] > t.total_s else 1.0
        times.append(RankTimes(t.fwd_s * scale, t.bwd_s * scale, t.wgrad_s * scale))
    return Links(tuple(times), hop, tuple(occupancy),
                 np.array([t.bwd_s for t in times]), np.array([t.total_s for t in times]),
                 np.array(ranks.elems, dtype=np.float64),
                 np.array(ranks.tensors, dtype=np.float64),
                 np.array(ranks.layers, dtype=np.float64),
                 max((g for _, g in ranks.hops), default=0))


def _with_loss(times: tuple[RankTimes, ...], c: Candidate, ranks: Ranks,
               setting: Setting) -> tuple[RankTimes, ...]:
    """``times`` with Megatron-Core's cross entropy (``smp_fx.planner.megatron_loss``) on
    the rank holding the last chunk, per microbatch."""
    size = 4 if setting.precision == "fp32" else 2
    fwd, bwd = loss_times(ranks.output_bytes, size, c.tp, setting.cluster.device)
    last = chunk_ranks(c.pp, c.vp, c.schedule)[-1]
    return tuple(RankTimes(t.fwd_s + fwd, t.bwd_s + bwd, t.wgrad_s) if r == last else t
                 for r, t in enumerate(times))


@dataclass(frozen=True)
class Pipeline:
    """What a step's pipeline costs (``pipeline``): the links with the exchanges added,
    the schedule's price, the exchanges per rank and microbatch, the elements held."""

    links: Links
    schedule: ScheduleCost
    ep_s: tuple[float, ...]
    cp_s: tuple[float, ...]
    held: tuple[int, ...]


def pipeline(c: Candidate, ranks: Ranks, setting: Setting, link: Links | None = None
             ) -> Pipeline:
    """The part of ``c``'s step its sharding (``zero``) does not change: the exchanges
    (module docstring, 4) and the schedule; the search prices it once for none, zero1
    and fsdp (11,753 for 22,802 fitting candidates: Mixtral-8x7B, 64 GPUs)."""
    spec = setting.cluster.device
    lk = link if link is not None else links(c, ranks, setting)
    ep_s, cp_s = exchange_times(c, ranks, setting.fabric, setting.runtime)
    if c.ep > 1 or c.cp > 1:
        gemm = [ep_change(g, c.ep, spec) for g in ranks.grouped] if c.ep > 1 else []
        lk = _exchanged(lk, c.cp, ep_s, cp_s, c.vp * spec.microbatch_overhead_s, gemm)
    held = held_elems(ranks, c.ep)
    if c.ep > 1:
        lk = replace(lk, elems=np.array(held, dtype=np.float64))
    sched = price_schedule(c.schedule, lk.times, c.microbatches(setting.global_batch), c.vp,
                           hop_s=lk.hop_s)
    return Pipeline(lk, sched, tuple(ep_s), tuple(cp_s), held)


def step_floor(pipe: Pipeline, setting: Setting) -> float:
    """A lower bound of ``price(...).step_time_s`` for any sharding of ``pipe``'s
    candidate, in floating point too: the step is rank 0's pipeline plus non-negative
    terms (exposed reductions, tied sums, optimizer). The search prices the rest only
    where it may reach the top k: 2-10 % of the fitting (docs/performance.md)."""
    return pipe.schedule.pipeline_s + setting.cluster.device.step_overhead_s


def price(c: Candidate, ranks: Ranks, profile: Profile, setting: Setting,
          link: Links | None = None, pipe: Pipeline | None = None,
          memory: tuple[int, MemoryPerGPU] | None = None) -> Priced:
    """The step of candidate ``c`` (module docstring); ``ranks`` is ``rank_loads`` of it,
    ``link`` its ``links``, ``pipe`` its ``pipeline`` and ``memory`` its ``peak_memory``
    (each computed here when not given)."""
    cl, spec = setting.cluster, setting.cluster.device
    fabric = setting.fabric
    m = c.microbatches(setting.global_batch)
    p, v = c.pp, c.vp
    s_bytes = state_bytes(setting.precision)
    pipe = pipe if pipe is not None else pipeline(c, ranks, setting, link)
    lk, sched, ep_s, cp_s, held = pipe.links, pipe.schedule, pipe.ep_s, pipe.cp_s, pipe.held
    pipeline_s = sched.pipeline_s
    # data parallelism, per distinct load (most ranks carry the same)
    reducers = replace(c, dp=c.dp * c.cp, cp=1)
    nodes, concurrent = (span(c, "cp_dp", cl.gpus_per_node) if c.cp > 1
                         else dp_placement(c, cl.gpus_per_node))
    colls: dict[tuple[str, float], Collective] = {}

    def dp(kind: str, nbytes: float) -> Collective:
        if (kind, nbytes) not in colls:
            colls[(kind, nbytes)] = collective_time(kind, nbytes, reducers.dp, fabric,
                                                    nodes=nodes, concurrent=concurrent)
        return colls[(kind, nbytes)]

    dp_s = zero_s = fsdp_s = tied_s = 0.0
    algorithm = "none"
    exposed = np.zeros(p)
    fsdp_extra = 0.0
    if reducers.dp > 1:
        per_elems = {e: (e * s_bytes.reduce, e * s_bytes.param) for e in set(held)}
        if c.zero == "fsdp":
            for r in range(p):
                small = ranks.small[r] if ranks.small else 0
                experts = held[r] - ranks.elems[r] + ranks.experts[r] if c.ep > 1 else 0
                big = held[r] - small - experts
                gather = dp("all_gather", big * s_bytes.param).seconds
                per_mb = 2 * gather + dp("reduce_scatter", big * s_bytes.reduce).seconds
                root = 0.0  # expert slices sharded over dp / ep ranks (else whole): in the
                if experts and c.dp > c.ep:  # root unit, gathered before each microbatch
                    root = m * (dp("all_gather", experts * s_bytes.param).seconds
                                + dp("reduce_scatter", experts * s_bytes.reduce).seconds)
                fsdp_s = max(fsdp_s, m * per_mb + root)
                fsdp_extra = max(fsdp_extra, m * max(0.0, per_mb - float(lk.total[r]))
                                 + gather / max(ranks.layers[r], 1))
                # the unsharded small tensors, summed over dp after the step, and the
                # root unit's experts: not hidden
                exposed[r] = dp("all_reduce", small * s_bytes.reduce).seconds + root
        elif setting.runtime == MEGATRON_CORE:
            grad_bytes = state_bytes(megatron_precision(setting.precision,
                                                        setting.megatron_grads)).reduce
            exposed, dp_s, zero_s, algorithm = _megatron_dp(
                c, ranks, lk, dp, grad_bytes, setting.precision,
                _expert_dp(c, fabric, cl.gpus_per_node))
        else:
            reduce = np.array([dp("all_reduce", per_elems[e][0]).seconds for e in held])
            grads = lk.elems * s_bytes.reduce
            bucket = reduce * np.minimum(1.0, DDP_BUCKET_BYTES / np.maximum(grads, 1.0))
            exposed = np.maximum(reduce - lk.bwd / v, bucket)
            dp_s = float(reduce.max())
            algorithm = dp("all_reduce", per_elems[held[0]][0]).algorithm
            if c.zero == "zero1":
                gathers = np.array([dp("all_gather", per_elems[e][1]).seconds for e in held])
                zero_s = float(gathers.max())
                exposed = exposed + gathers
    for key, elems in {k: n for sh in ranks.shared for k, n in sh}.items():
        holders = sum(1 for sh in ranks.shared if key in dict(sh))
        if holders > 1:
            tied = collective_time("all_reduce", elems * s_bytes.reduce, holders, fabric,
                                   nodes=holders if c.pp * c.tp > cl.gpus_per_node else 1)
            tied_s = max(tied_s, tied.seconds)
    pipeline_s += fsdp_extra
    shard = c.dp if c.zero != "none" and c.dp > 1 else 1
    if setting.runtime == MEGATRON_CORE and c.zero == "zero1":
        shard *= c.cp  # its distributed optimizer shards over dp x cp (overlap.py)
    opt = (np.maximum(1.0, np.floor(lk.tensors / shard)) * spec.optimizer_tensor_s
           + lk.elems * 4 / shard * spec.optimizer_byte_s)
    drain = np.concatenate([[0.0], np.cumsum(lk.bwd / v + lk.hop_s)[:-1]])
    step = float(np.max(pipeline_s - drain + exposed + tied_s + opt)) + spec.step_overhead_s
    mem_rank, mem = memory if memory is not None else peak_memory(c, ranks, profile, setting,
                                                                  lk.boundary)
    tp_step = m * max(ranks.tp_s)
    pp_step = m * max(lk.occupancy) if p > 1 else 0.0
    comm = CommTimes(tp_step, pp_step, dp_s, float(exposed.max()), zero_s, fsdp_s, tied_s,
                     algorithm, fsdp_extra, m * max(ep_s), m * max(cp_s))
    hw = sum(ranks.flops) * m * c.tp * c.dp  # a cp group shares each microbatch
    return Priced(c, m, step, pipeline_s, sched.bubble_fraction, float(opt.max()), comm, mem,
                  mem_rank, ranks.layers, hw)


def _exchanged(lk: Links, cp: int, ep_s: list[float], cp_s: list[float],
               fixed_s: float, gemm: Sequence[tuple[float, float]] = ()) -> Links:
    """``lk`` with each rank's compute (all but ``fixed_s`` per microbatch) split over
    ``cp``, its experts' grouped GEMMs repriced at ep (``gemm``: per rank, the forward
    and backward change, ``expert_gemm.ep_change``) and the exchanges added, half to the
    forward, half to the backward."""
    def split(t: float) -> float:
        return fixed_s + max(0.0, t - fixed_s) / cp

    change = list(gemm) or [(0.0, 0.0)] * len(lk.times)
    times = tuple(RankTimes(split(t.fwd_s) + g[0] / cp + (e + k) / 2,
                            split(t.bwd_s) + g[1] / cp + (e + k) / 2, t.wgrad_s / cp)
                  for t, e, k, g in zip(lk.times, ep_s, cp_s, change, strict=True))
    return replace(lk, times=times, bwd=np.array([t.bwd_s for t in times]),
                   total=np.array([t.total_s for t in times]))


def held_elems(ranks: Ranks, ep: int) -> tuple[int, ...]:
    """Per pipeline rank, the parameter elements it holds at ``ep``: 1/ep of its experts
    and all the rest (what its gradients reduce, its sharding gathers, its optimizer
    steps)."""
    if ep == 1 or not ranks.experts:
        return ranks.elems
    return tuple(e - x + -(-x // ep) for e, x in zip(ranks.elems, ranks.experts, strict=True))


def _expert_dp(c: Candidate, fabric: Fabric, gpus_per_node: int
               ) -> Callable[[str, float], Collective] | None:
    """Megatron-Core's expert data-parallel collectives: the dp / ep ranks holding the
    same experts (its expert grid, ``placement.megatron_expert_span``); None without."""
    size = c.dp // c.ep if c.ep > 1 else 1
    if size <= 1:
        return None
    nodes, concurrent = megatron_expert_span(c, "edp", gpus_per_node)

    @functools.lru_cache(maxsize=64)
    def edp(kind: str, nbytes: float) -> Collective:
        return collective_time(kind, nbytes, size, fabric, nodes=nodes,
                               concurrent=concurrent)
    return edp


def _megatron_dp(c: Candidate, ranks: Ranks, lk: Links,
                 dp: Callable[[str, float], Collective], reduce_bytes: int,
                 precision: str, edp: Callable[[str, float], Collective] | None = None
                 ) -> tuple[np.ndarray, float, float, str]:
    """(exposed per rank, reduction s, gather s, algorithm) of Megatron-Core's data
    parallelism: gradients reduce-scattered (``zero1``, the distributed optimizer) or
    all-reduced in buckets beside the last backward, parameters all-gathered beside the
    first forward (``--overlap-param-gather``), in half precision when training in it;
    at ep > 1 a rank's 1/ep of the experts over their ``edp`` ranks, the rest over dp."""
    kind = "reduce_scatter" if c.zero == "zero1" else "all_reduce"
    param_bytes = 4 if precision == "fp32" else 2
    bucket = megatron_bucket_elems(c.dp)
    fwd = lk.total - lk.bwd
    exposed = np.zeros(len(ranks.elems))
    reduce_s = gather_s = 0.0

    def both(kind: str, e: int, x: int, nbytes: int) -> float:
        """Seconds of one collective over a rank's dense part and its experts' slice."""
        if c.ep <= 1 or not x:
            return dp(kind, e * nbytes).seconds
        own = -(-x // c.ep)
        return dp(kind, (e - x) * nbytes).seconds + (
            edp(kind, own * nbytes).seconds if edp is not None else 0.0)

    experts = ranks.experts or (0,) * len(ranks.elems)
    for r, (e, x) in enumerate(zip(ranks.elems, experts, strict=True)):
        share = bucket / max(e, 1)
        red = both(kind, e, x, reduce_bytes)
        exposed[r] = overlapped(red, float(lk.bwd[r]) / c.vp, share)
        reduce_s = max(reduce_s, red)
        if c.zero == "zero1":
            gat = both("all_gather", e, x, param_bytes)
            exposed[r] += overlapped(gat, float(fwd[r]) / c.vp, share)
            gather_s = max(gather_s, gat)
    return exposed, reduce_s, gather_s, dp(kind, ranks.elems[0] * reduce_bytes).algorithm


FP8_WEIGHT_BYTES = 2
"""Bytes an FP8 linear's weight element adds (``Setting.fp8``): Transformer Engine keeps
its FP8 copy and the copy's transpose (1 byte each) beside the weight itself."""


def fp8_weights(c: Candidate, ranks: Ranks, profile: Profile, setting: Setting,
                r: int) -> int:
    """Bytes the FP8 weights add on rank ``r``: ``FP8_WEIGHT_BYTES`` an element of its
    repeated layers (every element of a layer counted as a linear's), under FSDP of one
    layer, gathered for its turn; a model without repeated layers, whose every linear runs
    in FP8: of all its elements (its largest unit's under FSDP). With ``fp8_params`` less
    the copy they replace: the weights as the runtime holds them (Megatron-Core: bf16).
    Negative where that copy is larger (fp32 weights)."""
    held = (megatron_precision(setting.precision, setting.megatron_grads)
            if setting.runtime == MEGATRON_CORE else setting.precision)
    per = FP8_WEIGHT_BYTES - (state_bytes(held).param if setting.fp8_params else 0)
    if not profile.layers:
        return per * (ranks.layer_elems if c.zero == "fsdp" else ranks.elems[r])
    layers = min(1, ranks.layers[r]) if c.zero == "fsdp" else ranks.layers[r]
    return per * profile.parts[2].param_elems * layers


def _memory(c: Candidate, ranks: Ranks, profile: Profile, setting: Setting, m: int,
            r: int, boundary: int) -> MemoryPerGPU:
    if setting.runtime == MEGATRON_CORE:  # the loss stays on the last stage: messages
        sends = max((act for act, _ in ranks.hops), default=0)  # carry no outputs
        last = chunk_ranks(c.pp, c.vp, c.schedule)[-1] == r
        state = megatron_precision(setting.precision, setting.megatron_grads)
        mem = _smp_memory(c, ranks, profile, setting, m, r, sends, state)
        mem = megatron_memory(c.dp, c.zero, held_elems(ranks, c.ep)[r], state, mem, c.cp,
                              megatron_logits(profile.output_bytes, c.tp, c.cp, last))
    else:
        mem = _smp_memory(c, ranks, profile, setting, m, r, boundary, setting.precision)
    if setting.fp8:
        mem = replace(mem, params=mem.params + fp8_weights(c, ranks, profile, setting, r))
    return mem


def _smp_memory(c: Candidate, ranks: Ranks, profile: Profile, setting: Setting, m: int,
                r: int, boundary: int, precision: str) -> MemoryPerGPU:
    layer = ranks.layer_elems  # an FSDP unit at ep > 1 gathers all but its expert slices
    if c.ep > 1 and ranks.elems[r]:
        layer = -(-layer * (ranks.elems[r] - ranks.experts[r]) // ranks.elems[r])
    return memory_per_gpu(
        elems=ranks.elems[r], buffers=ranks.buffers[r], kept=ranks.kept[r],
        in_flight=in_flight_at(c.schedule, c.pp, m, c.vp, r), transient=ranks.transient[r],
        precision=precision, zero=c.zero, dp=c.dp, layer_elems=layer,
        boundary=boundary, output_bytes=profile.output_bytes, pipelined=c.pp > 1,
        tensors=ranks.tensors[r], whole=ranks.small[r] if ranks.small else 0,
        step_temporary=setting.step_temporary,
        experts=ranks.experts[r] if ranks.experts else 0, ep=c.ep, cp=c.cp,
        gathered=ranks.kv[r] if ranks.kv and c.recompute != "full"
        and setting.runtime != MEGATRON_CORE else 0,  # its ring attention re-sends them
        local_outputs=setting.cp_local_outputs)


def peak_memory(c: Candidate, ranks: Ranks, profile: Profile, setting: Setting,
                boundary: int | None = None, stop_above: float | None = None
                ) -> tuple[int, MemoryPerGPU]:
    """The rank holding the most, and what it holds. Of a run of ranks with equal loads only
    those holding more in flight than the last one priced are priced (1F1B's fall with
    the rank index; ZB-V's grow when m < 2p - 1). ``stop_above``: the first rank found
    holding more bytes instead (the search wants no more of a candidate that neither
    fits nor needs the least: 152,000 ranks priced for 285,000, Mixtral-8x7B, 64 GPUs)."""
    m = c.microbatches(setting.global_batch)
    if boundary is None:
        boundary = max((g for _, g in ranks.hops), default=0)
    best: tuple[int, MemoryPerGPU] | None = None
    last: tuple[tuple[int, ...], float] | None = None
    for r in range(c.pp):
        sig = (ranks.elems[r], ranks.tensors[r], ranks.kept[r], ranks.transient[r],
               ranks.buffers[r])
        flight = in_flight_at(c.schedule, c.pp, m, c.vp, r)
        if last is not None and sig == last[0] and flight <= last[1]:
            continue
        last = (sig, flight)
        mem = _memory(c, ranks, profile, setting, m, r, boundary)
        total = mem.total
        if best is None or total > best[1].total:
            best = (r, mem)
        if stop_above is not None and total > stop_above:
            break
    assert best is not None
    return best


def memory_by_rank(c: Candidate, ranks: Ranks, profile: Profile,
                   setting: Setting) -> list[MemoryPerGPU]:
    """Each pipeline rank's peak memory (``cost_model.memory``) under ``c``'s schedule."""
    m = c.microbatches(setting.global_batch)
    boundary = max((g for _, g in ranks.hops), default=0)
    return [_memory(c, ranks, profile, setting, m, r, boundary) for r in range(c.pp)]


def model_flops(profile: Profile) -> float:
    """FLOPs of one microbatch through the whole model, forward and backward, no recompute
    (``profile`` at tensor-parallel degree 1)."""
    return sum(u.fwd_flops + u.bwd_flops for u in profile.units())


__all__ = ["DDP_BUCKET_BYTES", "FP8_WEIGHT_BYTES", "CommTimes", "Links", "Pipeline", "Priced",
           "Setting", "crosses_node", "dp_placement", "exchange_times", "fp8_weights",
           "held_elems", "links",
           "memory_by_rank", "model_flops", "peak_memory", "pipeline", "price", "step_floor"]
