"""Pipeline chunks of a model's parts, and what each rank holds of them.

Why: every candidate pipeline degree and virtual-stage count needs the model cut into
``pp x vp`` contiguous chunks and the chunks' loads summed per rank; the search asks for
thousands of such cuts, so both must be cheap.

- With repeated layers (head, first layer, ``n - 1`` equal layers, tail) the cut is a
  choice of how many layers the first and the last chunk take: the chunks between share
  the rest as evenly as possible (``split_layers``). Trying every (first, last) count
  around ``n / k`` and keeping the smallest slowest chunk (then the smallest largest layer
  count) is exact for this shape, with each chunk's sums done by counts, not by layer.
- Without repeated layers each computing node is a part and the partitioner's exact chain
  solver cuts them (``passes.partitioning.chain.solve``, slowest chunk minimised).

Chunk ``c`` goes to rank ``c mod p``; for ``zbv`` the chunks form a V (rank ``r`` holds
chunks ``r`` and ``2p - 1 - r``). A rank's recomputed layers keep the head's values they
read (the causal mask a traced Hugging Face model computes, sequence x sequence): one
tensor they share, counted once per rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from cost_model.device import DeviceSpec
from cost_model.schedule_cost import RankTimes
from passes.partitioning.chain import solve
from smp_fx.planner.expert_gemm import GroupedGemm
from smp_fx.planner.profile import PartCost, Profile


@dataclass(frozen=True)
class Ranks:
    """Per pipeline rank, per microbatch, for one tensor-parallel rank of it."""

    times: tuple[RankTimes, ...]
    tp_s: tuple[float, ...]
    elems: tuple[int, ...]
    tensors: tuple[int, ...]
    shared: tuple[tuple[tuple[str, int], ...], ...]
    buffers: tuple[int, ...]
    kept: tuple[int, ...]
    transient: tuple[int, ...]
    flops: tuple[float, ...]
    layers: tuple[int, ...]
    hops: tuple[tuple[int, int], ...]
    """(activation bytes, gradient bytes with the outputs) of each chunk boundary."""
    layer_elems: int
    small: tuple[int, ...] = ()
    """Elements of tensors below the persistence threshold, per rank."""
    experts: tuple[int, ...] = ()
    """Of ``elems``, the expert elements expert parallelism splits, per rank."""
    dispatch: tuple[int, ...] = ()
    """Bytes each MoE dispatch all-to-all sends each way, summed per rank per microbatch."""
    kv: tuple[int, ...] = ()
    """Bytes of keys and values context parallelism gathers, per rank per microbatch."""
    output_bytes: int = 0
    """The model's outputs per microbatch (``Profile.output_bytes``)."""
    grouped: tuple[tuple[tuple[GroupedGemm, int, int], ...], ...] = ()
    """Per rank, its experts' grouped GEMMs: (GEMM, forwards, forwards re-run in the
    backward) per microbatch (``smp_fx.planner.expert_gemm.ep_change``)."""


def chunk_ranks(p: int, v: int, schedule: str) -> list[int]:
    """The rank of each of the ``p x v`` chunks (module docstring).

    >>> chunk_ranks(2, 2, "interleaved"), chunk_ranks(2, 2, "zbv")
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    if schedule == "zbv":
        return [c if c < p else 2 * p - 1 - c for c in range(p * v)]
    return [c % p for c in range(p * v)]


@functools.lru_cache(maxsize=65536)
def split_layers(head: float, first: float, layer: float, tail: float, n: int,
                 k: int) -> tuple[int, ...]:
    """Layers per chunk (``k`` of them; the first also holds the head, the last the tail)
    minimising the slowest chunk, then the largest layer count (module docstring).

    >>> split_layers(0.5, 1.0, 1.0, 0.5, 8, 4)
    (2, 2, 2, 2)
    >>> split_layers(0.0, 1.0, 1.0, 3.0, 8, 3)
    (3, 4, 1)
    """
    if k == 1:
        return (n,)
    mid = k - 2
    best: tuple[float, int, int, int] | None = None
    q = math.ceil(n / k)
    top = n if k == 2 else min(n, q + 2 + int(max(head, tail) / max(layer, 1e-30)))
    extra_first = max(0.0, first - layer)
    for x in range(0, top + 1):
        t0 = head + (first + (x - 1) * layer if x else 0.0)
        ys = [n - x] if k == 2 else range(0, min(top, n - x) + 1)
        for y in ys:
            rest = n - x - y
            if rest < 0 or (mid > 0 and rest < mid) or (mid == 0 and rest != 0):
                continue
            widest = -(-rest // mid) if mid else 0  # _even gives the extra to the first
            t_mid = widest * layer + (extra_first if x == 0 else 0.0) if widest else 0.0
            holds_first = x == 0 and rest == 0
            t_last = tail + ((first + (y - 1) * layer if holds_first else y * layer)
                             if y else 0.0)
            key = (max(t0, t_mid, t_last), max(x, widest, y), x, y)
            if best is None or key < best:
                best = key
    assert best is not None
    _, _, x, y = best
    return (x, *_even(n - x - y, mid), y)


def _even(total: int, parts: int) -> list[int]:
    if parts == 0:
        return []
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@functools.lru_cache(maxsize=4096)
def _chain_cuts(times: tuple[float, ...], k: int) -> tuple[int, ...]:
    if k == 1:
        return ()
    return solve(np.zeros(len(times)), k, time=np.asarray(times)).cuts


def even_counts(n: int, k: int, ends: bool = False) -> tuple[int, ...] | None:
    """Megatron-Core's layers per chunk: n / k each (``get_num_layers_to_build``,
    core_r0.8.0; its arguments require k to divide n); with ``ends``
    (``account_for_embedding_in_pipeline_split`` and ``..._loss_...``) the embedding and
    the loss each count as a layer, so the first and last chunks build one layer fewer
    of (n + 2) / k. None where k does not divide them.

    >>> even_counts(8, 4), even_counts(126, 64, ends=True)[:2], even_counts(8, 3)
    ((2, 2, 2, 2), (1, 2), None)
    """
    total = n + 2 if ends else n
    if k > total or total % k:
        return None
    counts = [total // k] * k
    if ends:
        counts[0] -= 1
        counts[-1] -= 1
    return tuple(counts)


def chunks_of(profile: Profile, recompute: str, k: int, even: bool = False,
              ends: bool = False) -> list[list[tuple[PartCost, int]]] | None:
    """Each chunk's parts as (part, copies), or None when the model has fewer parts than
    ``k`` chunks need. ``even``: Megatron-Core's split (``even_counts``, ``ends`` its
    embedding and loss counted as layers), None where it does not divide; the head and
    tail ride on the first and last chunk."""
    if profile.layers:
        head, first, layer, tail = profile.parts
        n = profile.layers
        if even:
            counts = even_counts(n, k, ends)
            if counts is None:
                return None
        elif k > n:
            return None
        else:
            t = [sum(p.times(recompute)) for p in profile.parts]
            counts = split_layers(t[0], t[1], t[2], t[3], n, k)
        out, start = [], 0
        for i, c in enumerate(counts):
            chunk: list[tuple[PartCost, int]] = []
            if i == 0:
                chunk.append((head, 1))
            if c and start == 0:
                chunk.append((first, 1))
                chunk.append((layer, c - 1))
            elif c:
                chunk.append((layer, c))
            if i == k - 1:
                chunk.append((tail, 1))
            out.append([(p, n_) for p, n_ in chunk if n_ > 0])
            start += c
        return out
    units = profile.units()
    if k > len(units):
        return None
    cuts = _chain_cuts(tuple(sum(u.times(recompute)) for u in units), k)
    bounds = [0, *cuts, len(units)]
    return [[(u, 1) for u in units[a:b]] for a, b in zip(bounds, bounds[1:])]


def rank_loads(profile: Profile, recompute: str, p: int, v: int, schedule: str,
               spec: DeviceSpec, compute_factor: float = 1.0, even: bool = False,
               ends: bool = False) -> Ranks | None:
    """Each rank's share (module docstring) with the runtime's cost per action and message;
    ``compute_factor`` slows compute (not collectives) down, times the spec's
    ``pipelined_scale`` past one stage; ``even``, ``ends``: Megatron-Core's layer split
    (``chunks_of``)."""
    k = p * v
    chunks = chunks_of(profile, recompute, k, even, ends)
    if chunks is None:
        return None
    factor = compute_factor * (spec.pipelined_scale if p > 1 else 1.0)
    owner = chunk_ranks(p, v, schedule)
    f, b, w, tp, flops = ([0.0] * p for _ in range(5))
    elems, tensors, buffers, kept, transient, layers, small = ([0] * p for _ in range(7))
    experts, dispatch, kv, relayed = ([0] * p for _ in range(4))
    shared: list[dict[str, int]] = [{} for _ in range(p)]
    grouped: list[list[tuple[GroupedGemm, int, int]]] = [[] for _ in range(p)]
    hops: list[tuple[int, int]] = []
    layer_parts = set(map(id, profile.parts[1:3])) if profile.layers else set()
    for c, chunk in enumerate(chunks):
        r = owner[c]
        fixed = spec.microbatch_overhead_s + ((c > 0) + (c < k - 1)) * spec.message_overhead_s
        f[r] += fixed
        b[r] += fixed
        for part, n in chunk:
            pf, pb = part.times(recompute)
            rc_comm = part.tp_fwd_s if pb > part.bwd_s and recompute == "full" else 0.0
            f[r] += n * ((pf - part.tp_fwd_s) * factor + part.tp_fwd_s)
            b[r] += n * ((pb - part.tp_bwd_s - rc_comm) * factor + part.tp_bwd_s + rc_comm)
            w[r] += n * part.wgrad_s * factor
            tp[r] += n * (part.tp_fwd_s + part.tp_bwd_s + rc_comm)
            elems[r] += n * part.param_elems
            small[r] += n * part.small_elems
            experts[r] += n * part.expert_elems
            dispatch[r] += n * part.dispatch_bytes
            kv[r] += n * part.kv_bytes
            grouped[r] += [(g, n, n if pb - part.bwd_s > 0 and recompute == "full" else 0)
                           for g in part.grouped]
            tensors[r] += n * part.param_tensors
            for key, size in part.shared:
                if key not in shared[r]:
                    shared[r][key] = size
                    tensors[r] += 1
            buffers[r] += n * part.buffer_bytes
            kb, kt = part.kept(recompute)
            if recompute == "full" and id(part) in layer_parts:
                # each recomputed layer keeps the head's values it reads (a causal mask):
                # one tensor the rank's layers share, held once
                once = min(profile.relay_bytes, kb)
                kb -= once
                relayed[r] = max(relayed[r], once)
            kept[r] += n * kb
            transient[r] = max(transient[r], kt)
            flops[r] += n * (part.fwd_flops + part.bwd_flops + part.recompute_flops(recompute))
            if id(part) in layer_parts:
                layers[r] += n
        if c < k - 1:
            last = chunk[-1][0]
            between = id(last) in layer_parts and id(chunks[c + 1][0][0]) in layer_parts
            act = last.out_bytes + (profile.relay_bytes if between else 0)
            hops.append((act, act + profile.output_bytes))
    return Ranks(tuple(RankTimes(f[r], b[r], w[r]) for r in range(p)), tuple(tp),
                 tuple(elems[r] + sum(shared[r].values()) for r in range(p)), tuple(tensors),
                 tuple(tuple(sorted(s.items())) for s in shared), tuple(buffers),
                 tuple(k + once for k, once in zip(kept, relayed, strict=True)),
                 tuple(transient), tuple(flops), tuple(layers), tuple(hops),
                 max(part.param_elems for part in profile.parts), tuple(small), tuple(experts),
                 tuple(dispatch), tuple(kv), profile.output_bytes,
                 tuple(tuple(g) for g in grouped))


__all__ = ["Ranks", "chunk_ranks", "chunks_of", "rank_loads", "split_layers"]
