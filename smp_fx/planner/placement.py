"""Which nodes the groups of a plan's exchanges span, from the runtime's own rank layout.

Why exact: a group whose size the GPUs per node do not divide (a cp of 3 at tp 4 on
8-GPU nodes: ranks 0, 4, 8) spans nodes unevenly, and some groups of a layout straddle one
node more than others. The collectives are priced on the worst group (the step waits for
it): the most nodes any group spans and the most crossing groups sharing one node's
network. The groups are ``smp_fx.topology``'s (cp adjacent, strided by tp, inside dp)
and ``smp_fx.expert_ranks``'s (ep consecutive rdp ranks), under SMP's ``cluster``
placement.
"""

from __future__ import annotations

import functools
import itertools

from cost_model.errors import SMPConfigError
from smp_fx.expert_ranks import ep_groups
from smp_fx.planner.candidate import Candidate
from smp_fx.topology import Topology

AXES = ("cp", "ep", "cp_dp")
"""``cp_dp``: the ranks that reduce a parameter's gradients under context parallelism."""


def span(c: Candidate, axis: str, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, concurrent) of ``c``'s ``axis`` groups (module docstring): the most nodes
    one group spans and the most node-crossing groups with ranks on one node.

    >>> c = Candidate(4, 1, 1, 1, 1, "interleaved", "none", False, "none", 1, 3)
    >>> span(c, "cp", 8)  # ranks 0, 4, 8 and 1, 5, 9 ...: two nodes, 4 groups cross
    (2, 4)
    """
    return _span(c.pp, c.tp, c.dp, c.cp, c.ep, axis, gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _span(pp: int, tp: int, dp: int, cp: int, ep: int, axis: str, gpn: int
          ) -> tuple[int, int]:
    return _worst(_groups(Topology(pp, tp, dp, "DPT", cp), axis, ep), pp * tp * dp * cp, gpn)


def _worst(groups: list[list[int]], world: int, gpn: int) -> tuple[int, int]:
    """(the most nodes one group spans, the most node-crossing groups on one node)."""
    nodes, crossing = 1, [0] * -(-world // gpn)
    for g in groups:
        held = {r // gpn for r in g}
        nodes = max(nodes, len(held))
        if len(held) > 1:
            for node in held:
                crossing[node] += 1
    return nodes, max(1, max(crossing))


def megatron_expert_span(c: Candidate, axis: str, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, concurrent) of ``c``'s ``axis`` groups of Megatron-Core's expert grid:
    ``ep`` (the ranks exchanging tokens) or ``edp`` (the dp / ep ranks holding the same
    experts, reducing their gradients). Its default order ``tp-cp-ep-dp-pp``
    (``parallel_state.initialize_model_parallel``) at expert tensor parallelism 1
    (Megatron-Bridge's recipes) makes each ep group ``ep`` consecutive ranks of one
    pipeline stage, and each edp group ranks ``ep`` apart.

    >>> c = Candidate(1, 4, 16, 1, 1, "interleaved", "none", False, "none", 8)
    >>> megatron_expert_span(c, "ep", 8), megatron_expert_span(c, "edp", 8)
    ((1, 1), (2, 8))
    """
    if axis not in ("ep", "edp"):
        raise SMPConfigError.build("an expert grid axis is ep or edp", axis,
                                   "smp_fx.planner.placement.megatron_expert_span",
                                   "name ep or edp")
    return _megatron_expert(c.gpus, c.pp, c.ep, axis, gpus_per_node)


@functools.lru_cache(maxsize=1024)
def _megatron_expert(world: int, pp: int, ep: int, axis: str, gpn: int
                     ) -> tuple[int, int]:
    block = world // pp  # one pipeline stage's ranks
    edp = block // ep
    groups = ([[s * block + d * ep + e for e in range(ep)] for s in range(pp)
               for d in range(edp)] if axis == "ep" else
              [[s * block + d * ep + e for d in range(edp)] for s in range(pp)
               for e in range(ep)])
    return _worst(groups, world, gpn)


def _groups(topo: Topology, axis: str, ep: int) -> list[list[int]]:
    if axis == "cp":
        return topo.groups("cp")
    if axis == "ep":
        return [g for rdp in topo.groups("rdp") for g in ep_groups(rdp, ep)]
    if axis != "cp_dp":
        raise SMPConfigError.build(f"a group axis is one of {', '.join(AXES)}", axis,
                                   "smp_fx.planner.placement.span", "name a known axis")
    coords = itertools.product(range(topo.pp_size), range(topo.tp_size))
    return [sorted(topo.rank_of(p, t, d, k) for d in range(topo.rdp_size)
                   for k in range(topo.cp_size)) for p, t in coords]


__all__ = ["AXES", "megatron_expert_span", "span"]
