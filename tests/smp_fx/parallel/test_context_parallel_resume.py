"""Context parallelism across checkpoints and sequence lengths, on 2 gloo ranks against
one process: ``test_context_parallel_hf``'s tiny Llama, sdpa, Adam, global batch of 2.

One spawn runs in turn:

* cp 2: steps at sequence 128, 64 and 96 (each a multiple of 2cp), the loss and every
  gradient equal to one process's at each; the graph is traced once with the sequence
  symbolic (no re-planning at the new lengths). After the second step it saves a partial
  and a full checkpoint.
* cp 1 x rdp 2: the same 2 steps, the same saves: the saved tensors (model, Adam state,
  the full file) equal cp 2's (cp changes nothing saved), and the full file equals one
  process's ``state_dict()`` after 2 steps.
* cp 1 x rdp 2 resumes from cp 2's partial checkpoint, and cp 2 from cp 1's, each taking
  the third step: loss, gradients and ``state_dict()`` equal one process's three steps.

fp32, 1e-5. The resumed models start from other weights, so every one must be loaded.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.models import hf_zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks
from tests.smp_fx.parallel.test_context_parallel_hf import BATCH, LR, batches, build, join_world

LENGTHS = (128, 64, 96)
SAVED_AFTER = 2
TOL = {"atol": 1e-5, "rtol": 1e-5}
ARCH = "llama"
PARTIAL, FULL = "ck", "full"

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def step_batch(i: int) -> Batch:
    """Step ``i``'s global batch (ids, mask, targets), cut to ``LENGTHS[i]`` tokens."""
    ids, mask, y = batches(ARCH)[i]
    return ids[:, :LENGTHS[i]], mask[:, :LENGTHS[i]], y[:, :LENGTHS[i]]


def reference() -> dict[str, Any]:
    """One process: the loss and gradients of each step, ``state_dict()`` after 2 steps
    (at the save) and after 3."""
    model = build(ARCH)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads = [], []
    for i in range(len(LENGTHS)):
        if i == SAVED_AFTER:
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        ids, mask, y = step_batch(i)
        loss = hf_zoo.loss_fn(model(ids, mask), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return {"losses": losses, "grads": grads, "saved": saved,
            "final": {k: v.clone() for k, v in model.state_dict().items()}}


class Run:
    """The Llama and its Adam under ``smp.init`` at context-parallel degree ``cp`` (rdp =
    2 / cp), resumed from the partial checkpoint in the folder ``resume`` if given (from
    other weights, so what the checkpoint does not hold shows)."""

    def __init__(self, cp: int, resume: str | None = None) -> None:
        import smp_fx as smp
        from smp_fx.world import state

        state._reset()
        smp.init({"pipeline_parallel_degree": 1, "context_parallel_degree": cp, "ddp": True})
        plain = build(ARCH)
        if resume is not None:
            with torch.no_grad():
                for p in plain.parameters():
                    p.mul_(2.0)
        self.name = f"cp{cp}" + ("" if resume is None else f" from {resume}")
        self.model = smp.DistributedModel(plain)
        self.opt = smp.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=LR))
        if resume is not None:
            smp.resume_from_checkpoint(resume, tag=PARTIAL)

        @smp.step
        def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor,
                       y: torch.Tensor) -> Any:
            loss = hf_zoo.loss_fn(model(ids, mask), y)
            model.backward(loss)
            return loss

        self.train_step = train_step

    def step(self, i: int, ref: dict[str, Any]) -> list[str]:
        """Step ``i`` on this dp rank's share of the batch; what differs from ``ref``'s
        loss and gradients at that step."""
        import smp_fx as smp

        share = BATCH // smp.dp_size()
        mine = slice(smp.dp_rank() * share, (smp.dp_rank() + 1) * share)
        self.opt.zero_grad()
        out = self.train_step(self.model, *(t[mine] for t in step_batch(i)))
        loss = out.reduce_mean().detach()
        dist.all_reduce(loss, group=smp.get_dp_process_group())  # the global batch's
        grads = {n: p.grad for n, p in self.model.local_named_parameters()}
        self.opt.step()
        bad = [f"{self.name} grad {n} step {i}"
               for n in mismatched(grads, ref["grads"][i], **TOL)]
        want = ref["losses"][i]
        got = loss.item() / smp.dp_size()
        return bad + ([] if abs(got - want) <= 1e-5 else [f"{self.name} loss step {i}: "
                                                         f"{got} != {want}"])

    def state_differs(self, want: dict[str, torch.Tensor]) -> list[str]:
        return [f"{self.name} {m}" for m in state_dict_mismatches(
            dict(self.model.state_dict()), want, **TOL)]

    def save(self, folder: str) -> None:
        import smp_fx as smp

        smp.save_checkpoint(folder, PARTIAL, model=self.model, optimizer=self.opt)
        smp.save_checkpoint(folder, FULL, partial=False, model=self.model)


def _saved(folder: str) -> dict[str, Any]:
    """The objects of a checkpoint's model, optimizer and full files."""
    from smp_fx.ckpt.safe_load import read_file

    part = os.path.join(folder, f"{PARTIAL}_partial")
    return {"model": read_file(os.path.join(part, "model.pt_0"))["object"],
            "optimizer": read_file(os.path.join(part, "optimizer.pt_0"))["object"],
            "full": read_file(os.path.join(folder, FULL))}


def _differences(got: Any, want: Any, path: str) -> list[str]:
    """Where two saved objects differ: structure and values exactly, tensors within TOL."""
    if isinstance(want, torch.Tensor):
        return [path] if not isinstance(got, torch.Tensor) or mismatched(
            {path: got}, {path: want}, **TOL) else []
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{path} keys"]
        return [m for k in want for m in _differences(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{path} length"]
        return [m for i, (a, b) in enumerate(zip(got, want))
                for m in _differences(a, b, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def _traced_once(run: Run, built: Any) -> list[str]:
    """Whether the steps at 128, 64 and 96 tokens ran on the plan ``built`` at the first
    step, its sequence dimension symbolic."""
    from passes.input_dims import Free

    dims = built.shapes.dims.inputs
    bad = [] if dims and isinstance(dims[0].dims[1], Free) else [f"sequence fixed: {dims}"]
    return bad + ([] if run.model.parallelized is built else ["re-planned at a new length"])


def _all(packed: bytes, root: str) -> list[str]:
    import smp_fx as smp

    join_world()
    ref = torch.load(io.BytesIO(packed))
    at = {cp: os.path.join(root, f"cp{cp}") for cp in (1, 2)}
    cp2 = Run(2)
    bad = cp2.step(0, ref)
    built = cp2.model.parallelized
    bad += cp2.step(1, ref)
    cp2.save(at[2])
    bad += cp2.step(2, ref) + cp2.state_differs(ref["final"])
    bad += _traced_once(cp2, built) + ([] if smp.cp_size() == 2 else ["cp_size"])
    cp1 = Run(1)
    bad += cp1.step(0, ref) + cp1.step(1, ref)
    cp1.save(at[1])
    if smp.rank() == 0:
        got, want = _saved(at[2]), _saved(at[1])
        bad += [f"saved at cp 2: {m}" for m in _differences(got, want, "")]
        bad += [f"full file: {m}" for m in state_dict_mismatches(got["full"], ref["saved"],
                                                                 **TOL)]
    for cp, resume in ((1, at[2]), (2, at[1])):
        run = Run(cp, resume)
        bad += run.step(SAVED_AFTER, ref) + run.state_differs(ref["final"])
    return bad


@pytest.mark.multiproc
@pytest.mark.timeout(300)  # 4 models traced per rank: 7 s CPU a rank; 40-62 s wall at load 9-14
def test_cp_checkpoints_resume_at_another_cp_and_lengths_vary(tmp_path: Any) -> None:
    buf = io.BytesIO()
    torch.save(reference(), buf)
    results = run_ranks(_all, 2, buf.getvalue(), str(tmp_path), timeout=250,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    assert results == [[], []], results
