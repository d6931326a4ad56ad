"""Compiled stages with tensor parallelism under a split backward equal one process: pp 2 x
tp 2 on 4 gloo processes, compiled (``aot_eager``): the loss of every step, every gradient
(gathered over tp) after every step and the parameters after 3 Adam steps within 1e-5 of
the plain model trained in one process.

The GPT example runs under ZB-V with chunk 0's block checkpointed: chunk 0 (no input
path, its backward all W) is compiled in regions around the checkpointed block, which runs
eagerly (rebuilt once for I and W), the later chunks whole with their GEMMs' weight
gradients deferred to W (``deferred_gemms``), the tensor-parallel GEMMs among them. Nothing
falls back, nothing recompiles, and the tensor-parallel collectives sit inside compiled
graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from passes import meta
from passes.checkpoint_regions import Region
from smp_fx.runtime.executor.compiled import CompiledStage, compile_stages
from smp_fx.runtime.executor.compiled_regions import CompiledRegions
from smp_fx.runtime.executor.deferred_gemms import DeferredStage
from smp_fx.runtime.memory.checkpointing import outline_regions
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.models import example
from tests.helpers.reference import train_plain
from tests.smp_fx.runtime.executor.test_compiled import (
    _adam,
    _batch_loss,
    _batches,
    _Block,
    _compile_warnings,
    _Runner,
    _train_and_compare,
    _train_step,
)

STEPS = 3
TOL = {"atol": 1e-5, "rtol": 1e-5}
# (model, pipeline, virtual_pipeline_degree, chunk 0's block checkpointed)
CASES = (("gpt", "zbv", 2, True),)


def _model(arch: str, marked: bool) -> nn.Module:
    """The GPT example, 4 blocks: ZB-V's 4 chunks hold one each."""
    import smp_fx as smp

    torch.manual_seed(0)
    model = example(arch).build_model(n_layer=4)
    if marked:
        smp.set_tensor_parallelism(model)
    return model


def _references(path: Path) -> None:
    refs = {}
    for arch in sorted({a for a, *_ in CASES}):
        model = _model(arch, marked=False)
        run = train_plain(model, _adam(model.parameters()), _batches(arch),
                          functools.partial(_batch_loss, arch))
        refs[arch] = (run.losses, [{n: g for n, g in s.items() if g is not None}
                                   for s in run.grads], run.params)
    torch.save(refs, path)


def _compiled_graphs(model: Any) -> Iterator[CompiledStage]:
    """This rank's compiled stages and regions (those that did not fall back)."""
    for runner in model.parallelized.runners.values():
        for m in runner.module.modules():
            inner = (m._cut.children() if isinstance(m, CompiledRegions)
                     else (m._run,) if isinstance(m, DeferredStage) else (m,))
            yield from (c for c in inner
                        if isinstance(c, CompiledStage) and c.stats.fallback is None)


def _collectives_compiled(model: Any) -> bool:
    """Whether a compiled graph on this rank calls a tensor-parallel collective."""
    graphs = [c.stage.graph for c in _compiled_graphs(model)
              if isinstance(c.stage, torch.fx.GraphModule)]
    return any(n.op == "call_function"
               and getattr(n.target, "__module__", "") == "passes.tensor_parallel.collectives"
               for g in graphs for n in g.nodes)


def _case(arch: str, pipeline: str, v: int, checkpointed: bool, ref: Any) -> list[str]:
    import smp_fx as smp
    from smp_fx.world import state
    from tests.smp_fx.parallel.test_tensor_parallel import _gathered

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
              "microbatches": 2, "pipeline": pipeline, "virtual_pipeline_degree": v,
              "compile": "aot_eager"})
    model = smp.DistributedModel(_model(arch, marked=True))
    if checkpointed:
        smp.set_activation_checkpointing(model.module.h[0])
    opt = smp.DistributedOptimizer(_adam(model.parameters()))
    train_step = _train_step(arch)
    tag = f"{arch} {pipeline} v={v} tp=2"
    ref_losses, ref_grads, ref_params = ref
    bad = _train_and_compare(tag, arch, model, opt, train_step, ref_losses, ref_grads,
                             gather=_gathered)
    params = _gathered(model, {n: p.detach() for n, p in model.local_named_parameters()})
    bad += [f"{tag}: param {n}" for n in mismatched(params, ref_params, **TOL)]
    if model.tp_plan is None or not model.tp_plan.sharded or not _collectives_compiled(model):
        bad.append(f"{tag}: no tensor-parallel collective inside a compiled graph")
    for s, st in model.parallelized.compiled.items():
        cut = checkpointed and s == 0  # in regions around the block rebuilt once
        deferred = s != 0  # whole, its GEMMs' weight gradients deferred to W
        if (st.fallback is not None or st.recompiles or st.eager_regions
                or cut != bool(st.regions) or (len(st.regions) if cut else 1) != st.compiles
                or cut != (st.checkpointed == 1) or deferred != (st.deferred > 0)
                or st.gemms != 0):
            bad.append(f"{tag}: {st.summary()}, {st.compiles} compiles, "
                       f"{st.checkpointed} checkpointed")
    return bad


def _all_cases(path: str) -> tuple[list[str], list[str]]:
    from smp_fx.world import state

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    told = _compile_warnings()
    refs = torch.load(path, weights_only=True)
    try:
        bad = [b for arch, pipeline, v, ckpt in CASES
               for b in _case(arch, pipeline, v, ckpt, refs[arch])]
    finally:
        state._reset()
    return bad, [t for t in told if "recompute_once" not in t]


@pytest.mark.multiproc
def test_compiled_split_backward_with_tensor_parallelism_and_checkpointing(
        tmp_path: Path) -> None:
    """No WARNING but the checkpointed blocks' (eager, rebuilt once) on any rank."""
    path = tmp_path / "references.pt"
    _references(path)
    assert run_ranks(_all_cases, 4, str(path), timeout=600) == [([], [])] * 4


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Block(False), _Block(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return self.second(self.first(x)[0])


def test_a_first_chunk_compiles_around_its_checkpointed_block() -> None:
    """Under a split backward, chunk 0 (no input path) with its second block checkpointed
    (rebuilt once): the runs around the block compiled, the block eager, no GEMM cut; its
    W (the whole backward) gives the plain gradients."""
    torch.manual_seed(0)
    plain = _TwoBlocks()
    runner: Any = _Runner(_TwoBlocks())
    runner.stage.recvs = ()
    gm = runner.stage.module
    gm.load_state_dict(plain.state_dict())
    for n in gm.graph.nodes:
        if n.name.startswith("second_") or n.name in ("gelu_1", "add_1"):  # its gelu, residual
            meta.CKPT_REGION.set(n, Region("second"))
    outline_regions(gm, once=True)
    st = compile_stages({0: runner}, "aot_eager", "zbv")[0]
    assert isinstance(runner.module, CompiledRegions)
    assert (st.fallback, st.gemms, st.checkpointed, st.region_params) == (None, 0, 1, 0)
    assert "0 GEMMs eager, 1 checkpointed eager" in st.summary()

    x, g = torch.randn(4, 8), torch.randn(4, 8)
    (out,) = runner.forward([x], 0)
    grads, pending = runner.backward_input([out], [g], [x], 0)
    runner.backward_weight(pending, 0)
    (expected,) = plain(x)
    expected.backward(g)
    torch.testing.assert_close(out, expected)
    assert grads == [None]
    for (name, p), q in zip(gm.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert len(st.regions) == st.compiles >= 1 and not st.eager_regions
