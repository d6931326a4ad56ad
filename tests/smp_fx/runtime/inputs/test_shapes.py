"""Varying batch sizes and sequence lengths on a pipeline partitioned once.

Hugging Face GPT-2 and Llama (export-captured) at pp=2 train on batches of 8, 8, 4, 6 and
2 samples with sequence lengths 32, 24, 32, 24, 16 (microbatches of 4, 4, 2, 3 and 1) and
equal plain PyTorch in loss, gradients and parameters; the model is partitioned once (in
process, and on 2 processes for GPT-2). A dimension the graph fixed is refused by name
before anything runs, and a rank that receives a value of another shape than its own
inputs give names the input dimension; a tensor-parallel part of a value (static sizes
split, a marked split or gathered-batch value) is not a disagreement.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from cost_model.errors import SMPRuntimeError
from smp_fx.world import state
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import Pair, init

SHAPES = ((8, 32), (8, 24), (4, 32), (6, 24), (2, 16))
MODEL_KWARGS = {"hf_gpt2": {"n_positions": 32}, "hf_llama": {}}


def _batches(pair: Pair, shapes: tuple[tuple[int, int], ...]) -> list[Any]:
    vocab = pair.ex.VOCAB
    return [((torch.randint(0, vocab, (b, s)),), torch.randint(0, vocab, (b, s)))
            for b, s in shapes]


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    state._reset()


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hf_models_train_on_varying_shapes(name: str) -> None:
    init(2, 2, "interleaved")
    torch.manual_seed(3)
    pair = Pair(name, model_kwargs=MODEL_KWARGS[name])
    batches = _batches(pair, SHAPES)
    pair.x, pair.y = batches[0]
    pair.train_step(pair.dm, *pair.x, pair.y)  # partitions on the first shape
    plan, stages = pair.dm.plan, [s.module for s in pair.dm.program.stages]
    assert pair.dm.program.stages[0].recvs == () and pair.dm.program.stages[1].recvs
    pair.compare(len(SHAPES), 2, batches=batches)
    assert pair.dm.plan is plan  # never re-partitioned
    assert [s.module for s in pair.dm.program.stages] == stages
    _receiving_another_shape_names_the_input_dimension(pair)


def _receiving_another_shape_names_the_input_dimension(pair: Pair) -> None:
    """What a pp rank checks before its stage's forward across processes: the values it
    receives against the shapes its own inputs give (here activations built for sequence
    length 32 while this rank's inputs have 24)."""
    guard = pair.dm.parallelized.shapes
    assert guard is not None and guard.active
    mb = ((torch.randint(0, pair.ex.VOCAB, (2, 24)),), {})
    expected = guard._expect(1, guard._bindings(*mb))
    received = {n: torch.zeros(want[0]) for n, want in expected.items() if want is not None}
    assert any(24 in t.shape for t in received.values())
    guard.check_received(1, received, 1, *mb)  # agreeing shapes pass
    bad = {n: torch.zeros(*(32 if d == 24 else d for d in t.shape))
           for n, t in received.items()}
    with pytest.raises(SMPRuntimeError,
                       match=r"different shapes.*input 'input_ids' dimension 1: 24 on this "
                             r"rank, 32 on the sending rank"):
        guard.check_received(1, bad, 1, *mb)
    _tensor_parallel_parts_pass(pair, received, bad, mb)


def _tensor_parallel_parts_pass(pair: Pair, received: dict[str, torch.Tensor],
                                bad: dict[str, torch.Tensor], mb: Any) -> None:
    """With tp a value crossing the stages inside a pair is one rank's part: its static
    sizes (heads, features) are not the traced ones, the dim the rewrite split
    (``meta.TP_SPLIT``) may be a symbolic one, and a value on the tp group's gathered
    batch (``meta.TP_GATHERED``) has tp times the rank's batch."""
    from passes import meta

    guard = pair.dm.parallelized.shapes
    expected = guard._expect(1, guard._bindings(*mb))
    static = {n: [i for i in range(t.dim()) if i not in expected[n][2]]
              for n, t in received.items()}
    parts = {n: torch.zeros(*(d // 2 if i in static[n][-1:] else d
                              for i, d in enumerate(t.shape)))
             for n, t in received.items()}  # the last static dim halved, as a tp shard
    assert any(parts[n].shape != t.shape for n, t in received.items())
    guard.check_received(1, parts, 1, *mb)
    placeholders = {n.name: n for n in pair.dm.program.stages[1].module.graph.nodes
                    if n.op == "placeholder" and n.name in received}
    name = next(n for n, t in received.items() if t.shape[1] == 24)
    meta.TP_SPLIT.set(placeholders[name], 1)  # the seq dim marked split: not compared
    guard._expected.clear()
    try:
        guard.check_received(1, {**received, name: bad[name]}, 1, *mb)
        with pytest.raises(SMPRuntimeError, match="different shapes"):  # the others still are
            guard.check_received(1, bad, 1, *mb)
        for node in placeholders.values():
            meta.TP_GATHERED.set(node, True)
        guard._expected.clear()
        guard.check_received(1, bad, 1, *mb)  # a gathered batch: nothing compared
    finally:
        for node in placeholders.values():
            node.meta.pop(meta.TP_SPLIT.name, None)
            node.meta.pop(meta.TP_GATHERED.name, None)
        guard._expected.clear()




class _Branchy(nn.Module):
    """fx cannot trace the branch on a size, so export captures it and fixes dimension 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[1] == 8:
            h = torch.relu(h)
        return self.b(h)


def test_a_fixed_dimension_is_named_before_anything_runs() -> None:
    init(2, 2, "simple")
    torch.manual_seed(0)
    dm = smp.DistributedModel(_Branchy())

    @smp.step
    def fwd(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    with torch.no_grad():
        fwd(dm, torch.randn(4, 8))
        assert dm.module.a.weight.grad is None
        out = fwd(dm, torch.randn(6, 8)).concat()  # the batch dimension is free
        assert out.shape == (6, 4)
        with pytest.raises(SMPRuntimeError, match=r"fixed it to 8.*input 'x' dimension 1"):
            fwd(dm, torch.randn(4, 6))


def _two_ranks() -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(2, 2, "interleaved")
    torch.manual_seed(3)
    pair = Pair("hf_gpt2", model_kwargs={"n_positions": 32})
    shapes = ((4, 16), (4, 12), (2, 16))
    batches = _batches(pair, shapes)
    pair.x, pair.y = batches[0]
    worst = pair.compare(len(shapes), 2, batches=batches)
    assert pair.dm.executor.check_received is not None
    state._reset()
    return [worst]


@pytest.mark.multiproc
def test_two_processes_train_on_varying_shapes() -> None:
    results = run_ranks(_two_ranks, 2, timeout=240)
    assert all(r[0] <= 1e-5 for r in results)
