"""Outlining a stage's regions: same parameters and names, same values, torch checkpoint;
selective recomputation (every attention core a region) against one process, and the
bytes it keeps against the plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

import smp_fx as smp
from passes import meta
from passes.checkpoint_regions import Region
from smp_fx.runtime.memory.checkpointing import RegionCall, outline_regions
from tests.helpers.numerics import Pair, init


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = torch.relu(h)  # in the region
        side = h * 2  # outside, between region nodes in graph order, reads the region
        return self.c(self.b(g) + side)


def _outlined() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_Net())
    plain = torch.fx.GraphModule(gm, gm.graph)
    for n in gm.graph.nodes:
        if n.name in ("a", "relu", "b"):
            meta.CKPT_REGION.set(n, Region("r"))
    nodes = list(gm.graph.nodes)
    mul = next(n for n in nodes if n.name == "mul")
    relu = next(n for n in nodes if n.name == "relu")
    relu.append(mul)  # order: a, relu, mul, b: the outside node sits inside the region
    gm.recompile()
    outline_regions(gm)
    return plain, gm


def test_outlined_regions_keep_names_and_values() -> None:
    plain, gm = _outlined()
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in plain.named_parameters()]
    calls = [n.target for n in gm.graph.nodes if isinstance(n.target, RegionCall)]
    assert [c.name for c in calls] == ["r"]
    x = torch.randn(3, 4, requires_grad=True)
    out = gm(x)
    out.sum().backward()
    got = [p.grad.clone() for p in gm.parameters()] + [x.grad.clone()]
    for p in plain.parameters():
        p.grad = None
    x.grad = None
    want_out = plain(x)
    want_out.sum().backward()
    want = [p.grad for p in plain.parameters()] + [x.grad]
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_region_saves_only_its_inputs() -> None:
    _, gm = _outlined()
    packed: list[torch.Size] = []
    params = {p.data_ptr() for p in gm.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            packed.append(t.shape)
        return t

    x = torch.randn(3, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gm(x)
    # the region's input x, then c's input (the sum); nothing from inside the region
    assert packed == [torch.Size([3, 4]), torch.Size([3, 4])]


# ---- selective recomputation: every attention core recomputed, the rest kept ------------
def _gpt_pair(granularity: str, pipeline: str, full: bool = False, offload: bool = False
              ) -> Any:
    """The example GPT at pp 2 in one process, block 0 and what comes before on stage 0."""
    init(2, 2, pipeline, recompute_granularity=granularity, auto_partition=False,
         default_partition=0, offload_activations=offload)
    pair = Pair("gpt")
    for module in (pair.dm.module.h[1], pair.dm.module.ln_f, pair.dm.module.lm_head):
        smp.set_partition(module, 1)
    for block in pair.dm.module.h if full else ():
        smp.set_activation_checkpointing(block)
    return pair


@pytest.mark.parametrize("pipeline, offload", [("interleaved", True), ("zero_bubble", False)])
def test_selective_recomputation_trains_as_one_process(pipeline: str, offload: bool,
                                                       one_thread: None) -> None:
    """``recompute_granularity: selective`` (the cores' inputs offloaded; the split
    backward's I and W rebuilding each core once under ``zero_bubble``): loss, gradients,
    parameters of the unpartitioned model at 1e-5."""
    pair = _gpt_pair("selective", pipeline, offload=offload)
    pair.compare(2, 2)
    assert [st.checkpointed for st in pair.dm.plan.stages] == [
        ("h.0.attn.attention_core",), ("h.1.attn.attention_core",)]


def _kept(pair: Any) -> list[tuple[int, int]]:
    """Per stage: (bytes its forward saved, counted by its hooks, the plan's), the same for
    every microbatch of the second step."""
    pair.train_step(pair.dm, *pair.x, pair.y)
    for keeper in pair.dm.executor.keepers.values():
        keeper.track = True
    pair.train_step(pair.dm, *pair.x, pair.y)
    out = []
    for s, keeper in sorted(pair.dm.executor.keepers.items()):
        saved = {rec.saved for rec in keeper.records.values()}
        assert len(saved) == 1 and len(keeper.records) == 2, saved
        out.append((saved.pop(), pair.dm.plan.stages[s].memory.activations_per_microbatch))
    return out


def test_selective_keeps_less_than_none_and_more_than_full_as_planned(one_thread: None
                                                                      ) -> None:
    """The example GPT, the same stages each way: the bytes every stage's forward saves are
    the plan's to the byte, and selective lies strictly between none and full."""
    none, selective = _kept(_gpt_pair("none", "simple")), _kept(_gpt_pair("selective", "simple"))
    full = _kept(_gpt_pair("none", "simple", full=True))
    for measured, planned in (*none, *selective, *full):
        assert measured == planned
    for s in (0, 1):
        assert full[s][0] < selective[s][0] < none[s][0], s


def _selective_body() -> list[str]:
    """On 2 ranks: tp 2 (the whole GPT sharded, heads split, each rank's cores recomputed)
    and pp 2 under ``zero_bubble``; 3 Adam steps against one process on the global batch."""
    import torch.distributed as dist

    from smp_fx.world import state
    from tests.helpers.compare import mismatched
    from tests.helpers.twin import Twin
    from tests.helpers.twin import init as init_world
    from tests.smp_fx.parallel.test_tensor_parallel import _gathered

    def whole(t: Twin, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return values if t.dm.tp_plan is None else _gathered(t.dm, values)

    dist.init_process_group("gloo")
    bad: list[str] = []
    try:
        for pp, extra in ((1, {"tensor_parallel_degree": 2}), (2, {"pipeline": "zero_bubble"})):
            init_world(pp, 2, recompute_granularity="selective", **extra)
            t = Twin("gpt")
            if pp == 1:
                for module in (t.dm.module.wte, t.dm.module.lm_head, *t.dm.module.h):
                    smp.set_tensor_parallelism(module)
            opt = smp.DistributedOptimizer(torch.optim.Adam(t.dm.parameters(), lr=1e-3,
                                                            eps=1e-6))
            ref_opt = torch.optim.Adam(t.ref.parameters(), lr=1e-3, eps=1e-6)
            for step in range(3):
                opt.zero_grad()
                ref_opt.zero_grad()
                loss, ref_loss = t.smp_step(), t.ref_step()
                grads = whole(t, {n: p.grad for n, p in t.dm.local_named_parameters()})
                bad += [f"pp {pp} {extra}: loss at step {step}"] * (abs(loss - ref_loss) > 1e-5)
                bad += [f"pp {pp}: grad {n} at step {step}" for n in
                        mismatched(grads, t.reference(grads=True), atol=1e-5)]
                opt.step()
                ref_opt.step()
            params = whole(t, {n: p.detach() for n, p in t.dm.local_named_parameters()})
            bad += [f"pp {pp}: parameter {n}" for n in
                    mismatched(params, t.reference(), atol=1e-5)]
            if not all(st.checkpointed for st in t.dm.plan.stages):
                bad.append(f"pp {pp}: a stage without its attention core")
    finally:
        state._reset()
    return bad


@pytest.mark.multiproc
def test_selective_recomputation_across_processes_with_tp_and_a_split_backward() -> None:
    from tests.helpers.dist import run_ranks

    for bad in run_ranks(_selective_body, 2, timeout=240, env={"SMP_FX_DEVICE_SPEC": "a100"}):
        assert bad == [], bad
