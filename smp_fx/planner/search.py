"""The search over degrees, microbatching, schedules, recomputation and sharding.

Why this order of loops: what is costly is pricing a model's parts (a tenth of a second
per microbatch size, tp degree and sequence parallelism, ``smp_fx.planner.model``) and
cutting them into stages (cached per recompute mode, chunk count and placement,
``smp_fx.planner.stages``); everything inside is closed form (``smp_fx.planner.step``),
microseconds per candidate. So the loops go tp -> sp -> pp -> microbatch size ->
recompute -> (schedule, v) -> sharding, and ``--fix`` prunes each as early as it can.

The space: tp divides the GPU count and stays within a node unless fixed beyond it; pp
divides what is left and the model has at least pp x v layers (parts, without repeated
layers); dp is the rest and divides the global batch; the microbatch size divides the
per-replica batch (at most ``max_mbs``); v in 1, 2, 3, 4, 6, 8 for ``interleaved``,
``simple`` (looped BFS) and ``zero_bubble``, 2 for ``zbv``; recompute none, selective,
full (only none without repeated layers); sp with tp > 1; sharding none, zero1 and fsdp
with dp > 1; ep among the divisors of dp that divide every MoE block's expert count, cp
among the divisors of what tp x pp leave for a model with attention (GPUs = tp x pp x cp
x dp; a profile of one sample at tp 1 says which) whose sequence the runtime can cut into
2 cp chunks (``sequence_refusal``; the others counted as left out).

Every candidate with ep or cp > 1 is first put to ``smp.init``'s validation
(``smp_fx.planner.smp_config.refusal``, which reads ``smp_fx.config.combination_refusal``:
the runtime's one list of what it refuses) and left out, counted by rule, when refused;
with ep or cp fixed above 1 (``--fix``) they are priced instead as what-ifs, each marked
with its refusal (``SearchResult.what_if``), so the model's figure for a combination the
runtime does not run yet can be read. ``allowed`` may refuse more (``--emit-config``:
every candidate) and says why.
A candidate fits when its busiest GPU's memory (``cost_model.memory``) is within
``ClusterSpec.usable_memory_bytes``; fitting candidates are ranked by predicted step time.
Memory is priced first, for every candidate (the counts stay exact); a fitting one's step
only when its ``step_floor`` may reach the top k (docs/performance.md, "The planner's
search").
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cost_model.errors import SMPConfigError, SMPError
from cost_model.memory import ZERO, MemoryPerGPU
from cost_model.schedule_cost import check
from passes.context_parallel.collectives import local_index
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.exchange import expert_count
from smp_fx.planner.model import Profiler
from smp_fx.planner.overlap import MEGATRON_CORE
from smp_fx.planner.profile import Profile
from smp_fx.planner.smp_config import refusal
from smp_fx.planner.stages import Ranks, rank_loads
from smp_fx.planner.step import (
    Links,
    Pipeline,
    Priced,
    Setting,
    links,
    peak_memory,
    pipeline,
    price,
    step_floor,
)

VIRTUAL = (2, 3, 4, 6, 8)
Allowed = Callable[[Candidate], "str | None"]
Progress = Callable[[str], None]


@dataclass
class SearchResult:
    """The ranked plans that fit (best first) and what the search saw."""

    ranked: list[Priced]
    considered: int
    fitting: int
    smallest: Priced | None
    """The candidate needing the least memory, fitting or not."""
    refused: dict[str, int] = field(default_factory=dict)
    """Why candidates were left out (``allowed``'s reasons, profile problems), counted."""
    seconds: float = 0.0
    profiles: int = 0
    runtime_refused: int = 0
    """Candidates with ep or cp > 1 that ``smp.init`` refuses, left out (in ``refused``)."""
    what_if: dict[Candidate, str] = field(default_factory=dict)
    """Ranked candidates ``smp.init`` refuses, priced because ``--fix`` asked: the rule."""
    stepped: int = 0
    """Fitting candidates whose step was priced (the others' ``step_floor`` was above the
    ``top_k``-th step)."""

    @property
    def best(self) -> Priced | None:
        return self.ranked[0] if self.ranked else None


@functools.lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    """Every divisor of ``n``, ascending (kept: the search asks for the same few often).

    >>> divisors(12)
    (1, 2, 3, 4, 6, 12)
    """
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def schedule_options(pp: int, m: int, layers: int,
                     virtual: tuple[int, ...] = VIRTUAL) -> Iterator[tuple[str, int]]:
    """(schedule, v) pairs worth pricing at this pipeline degree (module docstring);
    ``virtual``: the v > 1 tried (a fixed v outside ``VIRTUAL`` is tried alone)."""
    if pp == 1:
        yield "interleaved", 1
        return
    for name in ("simple", "interleaved", "zero_bubble"):
        yield name, 1
    for v in virtual:
        if pp * v > max(layers, 1):
            break
        for name in ("interleaved", "simple", "zero_bubble"):
            if check(name, pp, m, v) is None:
                yield name, v
        if v == 2 and check("zbv", pp, m, 2) is None:
            yield "zbv", 2


def _zeros(dp: int) -> tuple[str, ...]:
    return ZERO if dp > 1 else ("none",)


def search(profiler: Profiler, setting: Setting, *, fixed: Mapping[str, Any] | None = None,
           allowed: Allowed | None = None, top_k: int = 10, max_mbs: int = 64,
           progress: Progress | None = None, prune: bool = True) -> SearchResult:
    """Price every candidate of the space (module docstring) not excluded by ``fixed`` or
    ``allowed``; keep the ``top_k`` fastest that fit. ``prune``: skip the step of a
    fitting candidate whose ``step_floor`` is above the ``top_k``-th step (the same result;
    False prices each, the check of that)."""
    fixed = dict(fixed or {})
    virtual = (int(fixed["vp"]),) if int(fixed.get("vp", 1)) > 1 else VIRTUAL
    start = time.perf_counter()
    n, batch = setting.gpus, setting.global_batch
    gpn = setting.cluster.gpus_per_node
    usable = setting.cluster.usable_memory_bytes
    layers = profiler.prepared.info.layers
    even = setting.runtime == MEGATRON_CORE  # its layer split (smp_fx.planner.stages)
    heap: list[tuple[float, int, Priced]] = []
    result = SearchResult([], 0, 0, None)
    loads: dict[tuple[Any, ...], Ranks | None] = {}
    link_of: dict[tuple[Any, ...], Links] = {}
    last_report = start

    def refuse(reason: str) -> None:
        result.refused[reason] = result.refused.get(reason, 0) + 1

    def want(key: str, value: Any) -> bool:
        return key not in fixed or fixed[key] == value

    smallest: tuple[tuple[int, MemoryPerGPU], Candidate, Ranks, Profile, Links] | None = None
    least = math.inf
    what_if = fixed.get("ep", 1) > 1 or fixed.get("cp", 1) > 1
    refused_by: dict[Candidate, str] = {}

    def runtime_refusal(c: Candidate) -> str | None:
        if c.ep == 1 and c.cp == 1:
            return None
        why = refusal(c, batch, setting.precision)
        return None if why is None else why.split(" (got ")[0]

    tps = [t for t in divisors(n) if want("tp", t) and (t <= gpn or "tp" in fixed)]
    attention = any(part.kv_bytes for part in profiler(1, 1, False).parts)
    experts = expert_count(profiler.prepared.graph)

    def eps(dp: int) -> list[int]:
        ok = divisors(math.gcd(dp, experts)) if experts else (1,)
        if "ep" in fixed and fixed["ep"] not in ok:
            refuse(f"ep {fixed['ep']} must divide dp ({dp}) and every MoE block's expert "
                   f"count ({experts or 'the model has no experts'})")
        return [e for e in ok if want("ep", e)]

    tokens = profiler.prepared.info.tokens_per_sample

    def pp_cp(rest: int) -> Iterator[tuple[int, int]]:
        for pp in divisors(rest):
            for cp in divisors(rest // pp) if attention else (1,):
                if not (want("pp", pp) and want("cp", cp)):
                    continue
                why = sequence_refusal(tokens, cp)
                if why is None:
                    yield pp, cp
                else:
                    refuse(why)
    unshardable: set[int] = set()
    for tp in tps:
        for sp in ((False, True) if tp > 1 else (False,)):
            if not want("sp", sp) or tp in unshardable:
                continue
            for pp, cp in pp_cp(n // tp):
                dp = n // (tp * pp * cp)
                if not want("dp", dp) or (layers and pp > layers):
                    continue
                if batch % dp:
                    refuse(f"global batch {batch} not divisible by dp {dp}")
                    continue
                for mbs in divisors(batch // dp):
                    if mbs > max_mbs and "mbs" not in fixed or not want("mbs", mbs):
                        continue
                    if tp in unshardable:
                        break
                    prof = profiler(mbs, tp, sp)
                    if prof.replicated:  # the sizes do not divide: no microbatch size helps
                        unshardable.add(tp)
                        refuse(f"tp {tp}: the tensor-parallel rewrite leaves "
                               f"{prof.replicated[0][0] or 'the model'!r} replicated "
                               f"({prof.replicated[0][1].split(' (')[0]})")
                        break
                    m = batch // (dp * mbs)
                    for rc in prof.recompute_modes:
                        if not want("recompute", rc):
                            continue
                        for sched, v in schedule_options(pp, m, layers or 10**9,
                                                         virtual):
                            if not (want("schedule", sched) and want("vp", v)):
                                continue
                            key = (mbs, tp, sp, rc, pp, v, sched == "zbv")
                            if key not in loads:
                                loads[key] = rank_loads(prof, rc, pp, v, sched,
                                                        setting.cluster.device,
                                                        setting.compute_factor, even,
                                                        setting.split_ends)
                            ranks = loads[key]
                            if ranks is None:
                                refuse(f"pp x vp = {pp * v} chunks exceed the model's parts"
                                       if not even or pp * v > layers + 2 * setting.split_ends
                                       else
                                       f"Megatron-Core splits the {layers} layers"
                                       + (" with the embedding and the loss"
                                          if setting.split_ends else "")
                                       + f" evenly: pp x vp = {pp * v} chunks do not "
                                       "divide them")
                                continue
                            link = link_of.get(key)
                            pipes: dict[int, Pipeline] = {}
                            for zero, ep in ((z, e) for z in _zeros(dp) for e in eps(dp)):
                                if not want("zero", zero):
                                    continue
                                cand = Candidate(tp, pp, dp, mbs, v, sched, rc, sp, zero,
                                                 ep, cp)
                                why = allowed(cand) if allowed is not None else None
                                if why is not None:
                                    refuse(why)
                                    continue
                                runtime = runtime_refusal(cand)
                                if runtime is not None and not what_if:
                                    result.runtime_refused += 1
                                    refuse(f"smp.init refuses {runtime}")
                                    continue
                                if link is None:
                                    link = link_of[key] = links(cand, ranks, setting)
                                mem = peak_memory(cand, ranks, prof, setting, link.boundary,
                                                  max(usable, least) if prune else None)
                                result.considered += 1
                                total = mem[1].total
                                if total < least:
                                    smallest, least = (mem, cand, ranks, prof, link), total
                                if total > usable:
                                    continue
                                result.fitting += 1
                                if ep not in pipes:
                                    pipes[ep] = pipeline(cand, ranks, setting, link)
                                if (prune and len(heap) == top_k
                                        and step_floor(pipes[ep], setting) > -heap[0][0]):
                                    continue
                                priced = price(cand, ranks, prof, setting, link, pipes[ep],
                                               mem)
                                result.stepped += 1
                                if runtime is not None:
                                    refused_by[cand] = runtime
                                item = (-priced.step_time_s, result.fitting, priced)
                                if len(heap) < top_k:
                                    heapq.heappush(heap, item)
                                elif item > heap[0]:
                                    heapq.heapreplace(heap, item)
                now = time.perf_counter()
                if progress is not None and now - last_report > 2.0:
                    last_report = now
                    best = max(heap)[2].step_time_s if heap else float("nan")
                    progress(f"tp {tp}{' sp' if sp else ''} pp {pp} cp {cp}: {result.considered} "
                             f"candidates priced, {result.fitting} fit, best step "
                             f"{best:.4g} s")
    if smallest is not None:
        mem, cand, ranks, prof, link = smallest
        result.smallest = price(cand, ranks, prof, setting, link, memory=mem)
    result.ranked = [item[2] for item in sorted(heap, key=lambda x: (-x[0], x[1]))]
    result.what_if = {p.candidate: refused_by[p.candidate] for p in result.ranked
                      if p.candidate in refused_by}
    result.seconds = time.perf_counter() - start
    result.profiles = profiler.priced
    return result


@functools.lru_cache(maxsize=256)
def sequence_refusal(tokens: int, cp: int) -> str | None:
    """Why context parallelism over ``cp`` ranks cannot cut a ``tokens``-long sequence
    (the runtime's rule, ``passes.context_parallel.collectives.local_index``), or None."""
    if cp == 1 or tokens <= 0:
        return None
    try:
        local_index(tokens, cp, 0, torch.device("meta"))
    except SMPError as exc:
        return f"cp {cp}: {str(exc).split(' (got ')[0]} ({tokens} tokens)"
    return None


def check_fixed(fixed: Mapping[str, Any], gpus: int, global_batch: int, layers: int) -> None:
    """Reject fixed values no candidate can have, naming the rule."""
    def bad(rule: str, value: Any, fix: str) -> SMPConfigError:
        return SMPConfigError.build(rule, value, "--fix", fix)

    for key in ("tp", "pp", "dp", "cp"):
        if key in fixed and gpus % fixed[key]:
            raise bad(f"{key} divides the GPU count ({gpus})", fixed[key],
                      f"pick {key} among {list(divisors(gpus))}")
    degrees = [fixed[k] for k in ("tp", "pp", "cp", "dp") if k in fixed]
    prod = 1
    for d in degrees:
        prod *= d
    if gpus % prod or (len(degrees) == 4 and prod != gpus):
        raise bad("tp x pp x cp x dp equals the GPU count",
                  {k: fixed[k] for k in ("tp", "pp", "cp", "dp") if k in fixed},
                  f"make their product {gpus}")
    if "ep" in fixed and "dp" in fixed and fixed["dp"] % fixed["ep"]:
        raise bad("ep divides dp (the ep group is carved out of the dp ranks)",
                  (fixed["ep"], fixed["dp"]), "pick ep among the divisors of dp")
    if "dp" in fixed and global_batch % fixed["dp"]:
        raise bad(f"dp divides the global batch ({global_batch})", fixed["dp"],
                  "change dp or --global-batch")
    if "dp" in fixed and "mbs" in fixed and (global_batch // fixed["dp"]) % fixed["mbs"]:
        raise bad("the microbatch size divides the batch per replica",
                  (fixed["mbs"], global_batch // fixed["dp"]), "change mbs")
    if "pp" in fixed and layers and fixed["pp"] * fixed.get("vp", 1) > layers:
        raise bad(f"pp x vp chunks each hold a layer (the model has {layers})",
                  fixed["pp"] * fixed.get("vp", 1), "lower pp or vp")
    if fixed.get("sp") and fixed.get("tp", 2) == 1:
        raise bad("sequence parallelism needs tp > 1", "sp=true, tp=1", "drop sp or raise tp")
    if fixed.get("zero") in ("zero1", "fsdp") and fixed.get("dp") == 1:
        raise bad("sharding needs data parallelism (dp > 1)", fixed["zero"], "drop zero")
    if fixed.get("schedule") == "zbv" and fixed.get("vp", 2) != 2:
        raise bad("zbv runs two chunks per rank", fixed.get("vp"), "set vp=2")


__all__ = ["VIRTUAL", "SearchResult", "check_fixed", "divisors", "schedule_options",
           "search", "sequence_refusal"]
