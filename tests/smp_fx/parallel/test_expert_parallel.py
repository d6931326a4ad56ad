"""Expert parallelism (``expert_parallel_degree``) against the one-process model.

The multi-process test: one spawn of 2 gloo ranks (dp 2, ep 2) trains the four MoE
families of ``examples/models/moe_zoo.py`` (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 with its
shared expert) for 3 steps with SGD and again with Adam (eps 1e-6; Adam's update is per
element, so its state must follow the slices; the Adam run trains the same
``DistributedModel`` after a fresh build's state was loaded into it, one trace a family),
each rank on its half of the global batch,
the gradients clipped to a norm of 0.5 (``clip_grad_norm_``: the whole model's norm, equal
to one process's, the experts' part summed over the ep group). Every local gradient at
every step (an expert slice against its experts' rows of the one-process gradient) and the
full ``state_dict()`` after them match the plain model trained on the whole batch in this
process (1e-5); so does each rank's load-balancing loss against the plain model's on that
rank's part, every step. Each rank holds 1/ep of the experts' parameter bytes and all of
the rest, as its plan counts them; every MoE block is expert-parallel; the gathered
``state_dict()`` loads into the plain model (ep 1), and the plain model's state loads back
into the split one (each rank its experts). A second spawn of 4 ranks runs Mixtral at
ep 2 x pp 2, then the four families with SGD and with Adam at ep 4 (one expert per
rank), the same checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples.models import moe_zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks

GLOBAL_BATCH, STEPS, LR, MAX_NORM = 4, 3, 0.05, 0.5
TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=LR),
              "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-6)}
CASES = tuple(f"{a}/{o}" for o in OPTIMIZERS for a in moe_zoo.ARCHITECTURES)
CE = torch.nn.functional.cross_entropy


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1234)
    return [(moe_zoo.inputs(GLOBAL_BATCH)[0], moe_zoo.targets(GLOBAL_BATCH))
            for _ in range(STEPS)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return CE(logits.flatten(0, -2), y.flatten())


def _outputs(model: Any, arch: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, load-balancing loss; 0 for a family without one)."""
    out = model(x)
    return out if arch in moe_zoo.AUX else (out, torch.zeros(()))


def step_function(arch: str) -> Any:
    """The ``smp.step`` training ``arch`` on cross entropy; it returns the aux loss."""
    import smp_fx as smp

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        logits, aux = _outputs(model, arch, x)
        model.backward(_loss(logits, y))
        return aux

    return train_step


def _reference(case: str, parts: int = 2) -> dict[str, Any]:
    """The plain model on the global batch: gradients each step, the final state, and
    each step's load-balancing loss of every microbatch (``parts`` of them: dp x m)."""
    arch, opt_name = case.split("/")
    model = moe_zoo.build(arch, aux=arch in moe_zoo.AUX)
    opt = OPTIMIZERS[opt_name](model.parameters())
    grads, aux, norms = [], [], []
    for x, y in _batches():
        with torch.no_grad():
            aux.append(torch.stack([_outputs(model, arch, part)[1]
                                    for part in x.chunk(parts)]))
        opt.zero_grad()
        _loss(_outputs(model, arch, x)[0], y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return {"grads": grads, "aux": aux, "norms": norms,
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict()}


def _expert_rows(want: dict[str, torch.Tensor], names: frozenset[str], ep: int,
                 rank: int) -> dict[str, torch.Tensor]:
    """``want`` with each expert tensor cut to the rows ep rank ``rank`` holds."""
    return {n: (t.chunk(ep)[rank] if n in names else t) for n, t in want.items()}


def _train(arch: str, refs: dict[str, Any], pp: int = 1, ep: int = 2,
           extra: dict[str, Any] | None = None, checkpointed: bool = False,
           opt_names: tuple[str, ...] = ("sgd",)) -> dict[str, Any]:
    """3 steps at ``ep`` (``pp`` stages of ``pp`` microbatches, ``extra`` configuration,
    every decoder layer checkpointed if asked) for each of ``opt_names`` in turn on one
    ``DistributedModel`` (one trace): what differs from ``refs[f"{arch}/{opt}"]``. Each
    run ends by loading a fresh build's state, where the next optimizer's run starts."""
    import smp_fx as smp
    from smp_fx.world import state as smp_state

    smp_state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": pp, "ddp": True,
              "expert_parallel_degree": ep, **(extra or {})})
    plain = moe_zoo.build(arch, aux=arch in moe_zoo.AUX)
    module = moe_zoo.build(arch, aux=arch in moe_zoo.AUX)
    for layer in module.model.model.layers if checkpointed else ():  # type: ignore[union-attr]
        smp.set_activation_checkpointing(layer)
    model = smp.DistributedModel(module)
    train_step = step_function(arch)
    share = GLOBAL_BATCH // smp.dp_size()
    sl = slice(smp.dp_rank() * share, (smp.dp_rank() + 1) * share)
    out = {}
    for opt_name in opt_names:
        ref = refs[f"{arch}/{opt_name}"]
        opt = smp.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()))
        names, rank = model.expert_names, smp.ep_rank()
        bad = []
        for step, (x, y) in enumerate(_batches()):
            opt.zero_grad()
            aux = train_step(model, x[sl], y[sl]).stack()  # one per microbatch
            want_aux = ref["aux"][step][smp.dp_rank() * pp:(smp.dp_rank() + 1) * pp]
            if not torch.allclose(aux, want_aux, **TOL):
                bad.append(f"aux loss step {step}: {aux} != {want_aux}")
            norm = model.clip_grad_norm_(MAX_NORM)  # the experts' part summed over ep
            if not torch.allclose(norm, ref["norms"][step], **TOL):
                bad.append(f"norm step {step}: {norm} != {ref['norms'][step]}")
            grads = {n: p.grad for n, p in model.local_named_parameters()
                     if p.grad is not None}
            want = _expert_rows(ref["grads"][step], names, ep, rank)
            bad += [f"grad {n} step {step}" for n in mismatched(grads, want, **TOL)]
            opt.step()
        gathered = model.state_dict()
        bad += state_dict_mismatches(gathered, ref["state"], **TOL)
        plain.load_state_dict(gathered)  # saved at ep 2, loaded at ep 1
        fresh = moe_zoo.build(arch, aux=arch in moe_zoo.AUX)
        model.load_state_dict(fresh.state_dict())  # every expert: each rank takes its own
        want = _expert_rows({n: p.detach() for n, p in fresh.named_parameters()}, names, ep,
                            rank)
        bad += [f"loaded {n}" for n in mismatched(dict(model.local_named_parameters()), want)]
        out[f"{arch}/{opt_name}"] = _held(model, plain, bad, ep)
    return out


def _held(model: Any, plain: Any, bad: list[str], ep: int) -> dict[str, Any]:
    """What the checks read of a rank's split model beside ``bad``: its ep coordinates,
    coverage, parameter bytes (experts, the rest; the plain model's) and planned bytes."""
    import smp_fx as smp

    names = model.expert_names
    local = dict(model.local_named_parameters())
    expert_bytes = sum(p.numel() * p.element_size() for n, p in local.items() if n in names)
    plain_expert = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
                       if n in names)
    rest = sum(p.numel() * p.element_size() for n, p in local.items() if n not in names)
    plain_rest = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
                     if n not in names)
    return {"bad": bad, "ep": (ep, smp.ep_rank()),
            "coverage": [b.line() for b in model.ep_coverage],
            "bytes": (expert_bytes, plain_expert, rest, plain_rest), "pp": smp.pp_rank(),
            "planned": (model.plan.stages[smp.pp_rank()].param_bytes,
                        sum(b.numel() * b.element_size() for b in plain.buffers()))}


def _all(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    return {case: result for arch in moe_zoo.ARCHITECTURES
            for case, result in _train(arch, refs, opt_names=tuple(OPTIMIZERS)).items()}


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_ep2_matches_single_process_model(tmp_path: Any) -> None:
    path = str(tmp_path / "reference.pt")
    refs = {case: _reference(case) for case in CASES}
    assert all(r["norms"][0] > MAX_NORM for r in refs.values())  # the clipping clips
    torch.save(refs, path)
    results = run_ranks(_all, 2, path, timeout=600)
    for case in results[0]:
        _check(case, [r[case] for r in results], ep=2)

def _check(case: str, got: list[dict[str, Any]], ep: int) -> None:
    """Every rank of a run at ``ep`` (dp = ep, one stage): nothing differs from one
    process, every MoE block expert-parallel, 1/ep of the expert bytes as planned."""
    assert [g["bad"] for g in got] == [[]] * ep, (case, [g["bad"] for g in got])
    assert [g["ep"] for g in got] == [(ep, r) for r in range(ep)], case
    lines = got[0]["coverage"]
    assert len(lines) == 2 and all(f"expert-parallel, {moe_zoo.EXPERTS // ep} of 4" in line
                                   for line in lines), (case, lines)
    for g in got:
        expert, plain_expert, rest, plain_rest = g["bytes"]
        assert plain_expert > 0 and expert * ep == plain_expert, (case, g["bytes"])
        assert rest == plain_rest, (case, g["bytes"])
        planned, buffers = g["planned"]  # the plan (memory model) sees the slices
        assert planned == expert + rest + buffers, (case, g["planned"], g["bytes"])


PIPELINED = "mixtral/sgd"
EP4 = CASES


PIPELINES: dict[str, dict[str, Any]] = {
    "zero_bubble": {"pipeline": "zero_bubble"},
    "zbv": {"pipeline": "zbv", "virtual_pipeline_degree": 2},
    "checkpointed": {},
}
"""ep 2 x pp 2 again: the split backward (ZB-H1), ZB-V at 2 virtual stages per rank (a
stage holding only expert slices among them), every decoder layer checkpointed."""


def _four(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    arch = PIPELINED.split("/")[0]
    return {"pp2": _train(arch, refs, pp=2)[PIPELINED],
            **{f"pp2 {label}": _train(arch, refs, pp=2, extra=extra,
                                      checkpointed=label == "checkpointed")[PIPELINED]
               for label, extra in PIPELINES.items()},
            **{case: result for arch in moe_zoo.ARCHITECTURES
               for case, result in _train(arch, refs, ep=4,
                                          opt_names=tuple(OPTIMIZERS)).items()}}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_ep2_pp2_and_ep4_match_single_process_model(tmp_path: Any) -> None:
    """4 ranks, 3 steps, the same checks: Mixtral (SGD) at 2 pipeline stages of 2
    microbatches, each stage's experts split over its 2 dp ranks (under 1F1B, then each of
    ``PIPELINES``); then at ep 4 (one expert
    per rank, every all-to-all over 4 ranks) the four families with SGD and with
    Adam (``CASES``)."""
    path = str(tmp_path / "reference.pt")
    torch.save({case: _reference(case, parts=4) for case in EP4}, path)  # dp x m = 4
    results = run_ranks(_four, 4, path, timeout=400)
    for run in ("pp2", *(f"pp2 {label}" for label in PIPELINES)):
        assert [r[run]["bad"] for r in results] == [[]] * 4, (run, [r[run]["bad"]
                                                                   for r in results])
    assert sorted((r["pp2"]["pp"], r["pp2"]["ep"]) for r in results) == [
        (0, (2, 0)), (0, (2, 1)), (1, (2, 0)), (1, (2, 1))]
    for case in EP4:
        _check(case, [r[case] for r in results], ep=4)
