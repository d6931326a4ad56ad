"""passes.in_place: a tensor written in place is read after its writes on every pipeline cut.

The models mimic transformers 4.26 Bloom's causal mask (``torch.empty`` filled by a slice
assignment in forward, then read by every layer), once as a tensor made in forward
(Bloom's) and once as a registered buffer; a third model makes a constant in forward, which
export detaches in place. Every cut of the graph into 2 stages, as the
partitioners leave it, runs as separate processes would (each stage its own copy of the
modules, values exchanged as copies) and equals one process.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from cost_model.errors import SMPPartitionError
from passes import in_place, meta
from passes.in_place import colocate, groups
from passes.partitioning.extract import COMPUTE_OPS, write_stages
from passes.split_stages import StagedProgram, split_stages
from passes.trace import trace

SEQ = 5


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(h).chunk(2, -1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(mask, -1e4).softmax(-1)
        return h + self.out(scores @ h)


class EmptyMask(nn.Module):
    """Bloom's ``_make_causal_mask`` in transformers 4.26, in front of two attention blocks."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab)

    def causal(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        mask = torch.empty((t, t), dtype=torch.bool, device=ids.device)
        seq = torch.arange(t, device=ids.device)
        mask[:, 0:] = seq[:, None] < seq[None, :]
        return mask[None, None, :, :].expand(b, 1, t, t)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = self.causal(ids)
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h)


class BufferMask(EmptyMask):
    """The same mask in a buffer, written in place at every forward; all True until then
    (every score masked), so a stage that reads it unwritten computes something else."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(SEQ, SEQ, dtype=torch.bool), persistent=False)

    def causal(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        seq = torch.arange(t, device=ids.device)
        self.mask[:, :] = seq[:, None] < seq[None, :]
        return self.mask[None, None].expand(b, 1, t, t)


class ScaledByConstant(EmptyMask):
    """A constant made in forward (``torch.tensor``: export's ``lift_fresh_copy`` then an
    in-place ``detach_``), read after the blocks: a cut between the two hands the
    ``detach_`` a received tensor."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = self.causal(ids)
        h = self.emb(ids)
        scale = torch.tensor(0.5)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h) * scale


def _run_as_processes(prog: StagedProgram, *args: Any) -> Any:
    """``prog`` as separate processes run it: each stage its own copy of the buffers (taken
    before anything ran), every value it receives a copy, viewed as the transport's
    receive buffers view it. A stage module's containers are
    its own (fx copies the attribute paths), so replacing a buffer there touches no other."""
    for st in prog.stages:
        for name, buffer in list(st.module.named_buffers()):
            path, _, leaf = name.rpartition(".")
            setattr(st.module.get_submodule(path), leaf, buffer.clone())
    inputs = prog.bind_inputs(args, {})
    env: dict[str, Any] = {}
    last: tuple[Any, ...] = ()
    for st in prog.stages:
        vals = [inputs[n] if n in st.program_inputs else env[n] for n in st.input_names]
        last = st.module(*[v.clone().view_as(v) if isinstance(v, torch.Tensor) else v
                           for v in vals])
        env.update(zip(st.output_names, last))
    return prog.build_outputs(last)


@functools.cache
def _traced(build: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, torch.fx.GraphModule]:
    """The model (seed 0), its input and its export graph, once per model class; the
    model's own buffer is never written (each run writes its stages' copies)."""
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 16, (2, SEQ))
    return model, ids, trace(model, (ids,), frontend="export")


def _cuts(gm: torch.fx.GraphModule) -> list[dict[str, int]]:
    names = [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    return [{n: int(i >= k) for i, n in enumerate(names)} for k in range(1, len(names))]


# the buffer's readers read the result of export's ``copy_`` into it: data flow orders them
@pytest.mark.parametrize(("build", "grouped"), [(EmptyMask, True), (BufferMask, False),
                                                (ScaledByConstant, True)])
def test_every_cut_equals_one_process(build: type[nn.Module], grouped: bool) -> None:
    model, ids, gm = _traced(build)
    want = copy.deepcopy(model)(ids)
    assert bool(groups(gm)) == grouped
    moved = []
    for cut in _cuts(gm):
        before = dict(cut)
        kept = colocate(gm, cut)
        assert cut == before  # its input is not changed
        prog = split_stages(write_stages(gm, kept), 2)
        torch.testing.assert_close(_run_as_processes(prog, ids), want, rtol=1e-5, atol=1e-5)
        if kept != cut:
            moved.append(cut)
    if grouped:  # some cut separates the write from the tensor or its reads
        with pytest.raises(SMPPartitionError, match="written in place"):
            split_stages(write_stages(gm, moved[0]), 2)
    assert bool(moved) == grouped


def test_a_split_write_computes_something_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rule (the check skipped) some cut reads the mask unwritten: what the
    test above guards against is real."""
    model, ids, gm = _traced(EmptyMask)
    want = model(ids)
    monkeypatch.setattr(in_place, "check", lambda gm, stage_of: None)
    wrong = [cut for cut in _cuts(gm) if colocate(gm, cut) != cut and not torch.allclose(
        _run_as_processes(split_stages(write_stages(gm, cut), 2), ids), want)]
    assert wrong


def test_pins_decide_and_conflicting_pins_are_refused() -> None:
    gm = _traced(EmptyMask)[2]
    (group,) = groups(gm)
    write = next(n for n in group if n.startswith("copy_"))
    stages = {n.name: 0 for n in gm.graph.nodes if n.op in COMPUTE_OPS}
    stages[write] = 1
    kept = colocate(gm, stages, movable=lambda name: name != write)
    assert {kept[n] for n in group} == {1}
    other = next(n for n in sorted(group) if n != write)
    with pytest.raises(SMPPartitionError, match="pin the modules"):
        colocate(gm, stages, movable=lambda name: name not in (write, other))


@pytest.mark.parametrize(("auto", "pins"), [
    (True, {}), (False, {"blocks.1": 1, "head": 1}),  # the mask's glue follows the pins
])
def test_the_partitioners_keep_the_mask_with_its_write(auto: bool, pins: dict[str, int]
                                                       ) -> None:
    """The compile pipeline (automatic partition, or ``smp.partition`` pins): the group on
    one stage, the split program equals one process."""
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model

    model, ids, gm = _traced(EmptyMask)
    compiled = compile_model(model, (ids,), None,
                             PartitionConfig(num_stages=2, auto_partition=auto), pins=pins,
                             traced=gm)
    by_name = {n.name: n for n in compiled.gm.graph.nodes}
    for group in groups(compiled.gm):
        assert len({meta.STAGE.get(by_name[n]) for n in group}) == 1, group
    prog = split_stages(compiled.gm, 2)
    torch.testing.assert_close(_run_as_processes(prog, ids), model(ids), rtol=1e-5, atol=1e-5)
