"""Tensor parallelism composed with ZeRO-1 and with sharded data parallelism, on gloo ranks.

One spawn of 4 ranks runs every 4-rank case in sequence, one spawn of 8 ranks the 3-D
case; the references are trained in the test process and shipped by file. Each dp rank
trains on its own slice of the global batch (``prescaled_batch`` false).

* numerics, 3 Adam steps against one process training the plain model on the global batch
  (clipped to SMP's default ``sdp_gradient_clipping`` 1.0 where sdp clips): every local
  gradient at every step (sdp shards gathered over the shard group, tp shards over tp),
  ``optimizer._global_grad_norm`` at every step (sdp), ``state_dict()`` after the steps,
  fp32, 1e-5. tp 2 x ZeRO-1 over rdp 2 and tp 2 x sdp 2 on the example GPT (tied ``wte`` /
  ``lm_head`` split by vocabulary rows); tp 2 x sdp 2 on HF Llama, tp 2 x ZeRO-1 on HF
  GPT-NeoX (both from configs); pp 2 x tp 2 x sdp 2 on 8 ranks (the example GPT, its tie
  across the stages);
* memory on the example GPT: parameter, gradient and optimizer-state bytes per rank at
  tp 2 x sdp 2 equal the planner's memory model (``cost_model.memory``); at tp 2 x
  ZeRO-1 parameters and gradients equal it, the state within one parameter's of its 1/rdp;
* checkpoints across layouts, each leg resuming the previous leg's checkpoint and taking
  one more step, the last leg's ``state_dict()`` equal to the uninterrupted reference:
  tp 2 x sdp 2 -> tp 1 x sdp 4 -> tp 4 x sdp 1 -> tp 2 x sdp 2 (partial checkpoints), and
  ZeRO-1 tp 2 x dp 2 -> (the full ``state_dict()`` of model and optimizer) tp 1 x dp 4 ->
  (a partial checkpoint) tp 2 x dp 2;
* precision against one smp-fx process under the same precision: fp16 x sdp 2 (HSDP over
  rdp 4) with a dynamic loss scale whose first step overflows, and bf16 x tp 2 x sdp 2:
  losses each step within 1e-3 relative, the overflow step skipped on every rank alike,
  parameters after 3 steps within the precision's resolution.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.reference import train_plain
from tests.smp_fx.parallel.test_sharding_dist import _shared_dir
from tests.smp_fx.parallel.test_tensor_parallel import ADAM_EPS, _gathered

GLOBAL_BATCH, STEPS, LR = 8, 3, 1e-3
TOL = {"atol": 1e-5, "rtol": 1e-5}
SDP = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 64}
ZERO = {"shard_optimizer_state": True}
# numerics cases: (model, pp, tp, extra configuration)
FOUR = (("gpt", 1, 2, ZERO), ("gpt", 1, 2, SDP), ("llama", 1, 2, SDP), ("neox", 1, 2, ZERO))
EIGHT = (("gpt", 2, 2, SDP),)
# checkpoint chains: legs of (tp, extra, full state dicts after the leg, else a partial
# checkpoint)
NO_CLIP = {"sdp_gradient_clipping": 0.0, "sdp_param_persistence_threshold": 64}
CHAINS = {"sdp": ((2, {"sharded_data_parallel_degree": 2, **NO_CLIP}, False),
                  (1, {"sharded_data_parallel_degree": 4, **NO_CLIP}, False),
                  (4, {}, False),
                  (2, {"sharded_data_parallel_degree": 2, **NO_CLIP}, False)),
          "zero": ((2, ZERO, True), (1, ZERO, False), (2, ZERO, False))}
# precision cases: name -> (tp, configuration, optimizer arguments, parameter tolerance)
SCALE = {"dynamic_loss_scale": True,  # 2**24 overflows fp16 at the first step, 2**16 not
         "dynamic_loss_args": {"init_scale": 2.0**24, "scale_factor": 2.0**8}}
PRECISION = {"fp16": (1, {"fp16": True, **NO_CLIP, "sharded_data_parallel_degree": 2},
                      SCALE, 2e-3),
             "bf16": (2, {"bf16": True, **NO_CLIP, "sharded_data_parallel_degree": 2},
                      {}, 1.6e-2)}


def build(kind: str) -> torch.nn.Module:
    """The model of ``kind``, marked for tensor parallelism, seeded alike everywhere."""
    import smp_fx as smp
    from examples.models import hf_zoo
    from tests.helpers.models import example

    torch.manual_seed(0)
    if kind == "gpt":
        gpt = example("gpt").build_model()
        for module in (gpt.wte, gpt.lm_head, *gpt.h):
            smp.set_tensor_parallelism(module)
        return gpt
    return hf_zoo.build({"llama": "llama", "neox": "gpt_neox"}[kind])


def batches(kind: str, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from examples.models import hf_zoo
    from tests.helpers.models import example

    torch.manual_seed(1234)
    if kind == "gpt":
        ex = example("gpt")
        return [(ex.example_inputs(GLOBAL_BATCH)[0], ex.example_targets(GLOBAL_BATCH))
                for _ in range(steps)]
    arch = {"llama": "llama", "neox": "gpt_neox"}[kind]
    return [(hf_zoo.inputs(arch, GLOBAL_BATCH)[0], hf_zoo.targets(arch, GLOBAL_BATCH))
            for _ in range(steps)]


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.float().flatten(0, -2), y.flatten())


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, eps=ADAM_EPS)


def reference(kind: str, clip: float | None, steps: int = STEPS) -> tuple[Any, ...]:
    """One process, the plain model, the global batch, the norm clipped to ``clip`` as
    sharded data parallelism's ``sdp_gradient_clipping`` does: each step's gradients, the
    final ``state_dict()``, each step's norm before clipping."""
    model = build(kind)
    run = train_plain(model, adam(model.parameters()), batches(kind, steps),
                      lambda m, b: loss(m(b[0]), b[1]), clip=clip)
    return run.grads, run.state, run.norms


def clip_of(extra: dict[str, Any]) -> float | None:
    """The norm a configuration clips to (SMP's default 1.0 with sdp), or None."""
    if extra.get("sharded_data_parallel_degree", 1) == 1:
        return None
    return float(extra.get("sdp_gradient_clipping", 1.0)) or None


def start(kind: str, pp: int, tp: int, extra: dict[str, Any],
          opt_args: dict[str, Any] | None = None) -> tuple[Any, Any, Any, slice]:
    """``smp.init`` at this layout; (model, optimizer, step function, this rank's slice)."""
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "ddp": True,
              "microbatches": 2, **extra})
    model = smp.DistributedModel(build(kind))
    opt = smp.DistributedOptimizer(adam(model.parameters()), **(opt_args or {}))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = loss(model(x), y)
        model.backward(out)
        return out

    share = GLOBAL_BATCH // smp.dp_size()
    return model, opt, train_step, slice(smp.dp_rank() * share, (smp.dp_rank() + 1) * share)


def whole(model: Any, values: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's local ones: sdp shards gathered, then tp shards."""
    full = {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in values.items()
            if v is not None}
    return _gathered(model, full)


def run_case(kind: str, pp: int, tp: int, extra: dict[str, Any], path: str) -> list[str]:
    """Train one configuration; what differs from the reference."""
    ref_grads, ref_state, ref_norms = torch.load(path, weights_only=True)
    tag = f"{kind} pp{pp} tp{tp} {','.join(sorted(extra))}"
    model, opt, train_step, sl = start(kind, pp, tp, extra)
    bad: list[str] = []
    for step, (x, y) in enumerate(batches(kind)):
        opt.zero_grad()
        train_step(model, x[sl], y[sl])
        grads = whole(model, {n: p.grad for n, p in model.local_named_parameters()})
        bad += [f"{tag}: grad {n} step {step} {_diff(grads[n], ref_grads[step][n])}"
                for n in mismatched(grads, ref_grads[step], **TOL)]
        opt.step()
        if ref_norms and abs(opt._global_grad_norm - ref_norms[step]) > 1e-5 * ref_norms[step]:
            bad.append(f"{tag}: _global_grad_norm {opt._global_grad_norm} vs "
                       f"{ref_norms[step]} step {step}")
    if kind == "gpt" and pp == 1:
        bad += [f"{tag}: {m}" for m in memory_differs(model, opt, extra)]
    return bad + _state_differs(tag, model.state_dict(), ref_state)


def memory_differs(model: Any, opt: Any, extra: dict[str, Any]) -> list[str]:
    """This rank's parameter, gradient and optimizer-state bytes against the planner's
    memory model (``cost_model.memory``) for its tp shard: sharded data parallelism
    exactly; ZeRO-1 shards whole parameters, so each rank's state is within one
    parameter's of the model's 1/dp and the rdp group's sum is the model's whole state."""
    import smp_fx as smp
    from cost_model.memory import memory_per_gpu

    params = list({id(p): p for _, p in model.local_named_parameters()}.values())
    threshold = extra.get("sdp_param_persistence_threshold", 0)
    sdp = "sharded_data_parallel_degree" in extra
    want = memory_per_gpu(
        elems=sum(p.numel() for p in params), buffers=0, kept=0, in_flight=0, transient=0,
        precision="fp32", zero="fsdp" if sdp else "zero1", dp=smp.rdp_size(), layer_elems=0,
        boundary=0, output_bytes=0, pipelined=False, tensors=len(params),
        whole=sum(p.numel() for p in params if sdp and p.numel() < threshold))
    local = [getattr(p, "_local_tensor", p) for p in params]
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params]
    got = {"params": sum(t.numel() * 4 for t in local),
           "grads": sum(g.numel() * 4 for g in grads if g is not None),
           "optimizer": opt.local_state_bytes()}
    bad = [f"{k} bytes {got[k]} vs the model's {getattr(want, k)}"
           for k in ("params", "grads", "optimizer" if sdp else "") if k
           and got[k] != getattr(want, k)]
    if not sdp:
        whole = sum(8 * p.numel() + 4 for p in params)
        total = sum(smp.allgather(got["optimizer"], smp.RDP_GROUP))
        most = max(8 * p.numel() + 4 for p in params)
        if total != whole or abs(got["optimizer"] - want.optimizer) > most:
            bad.append(f"optimizer bytes {got['optimizer']} (rdp sum {total}) vs the "
                       f"model's {want.optimizer} (whole {whole})")
    return bad


def run_chain(name: str, path: str, folder: str) -> list[str]:
    """The legs of ``CHAINS[name]``: two steps, then one more after each resume."""
    import smp_fx as smp

    legs = CHAINS[name]
    _, ref_state, _ = torch.load(path, weights_only=True)
    data = batches("gpt", len(legs) + 1)
    model: Any = None
    for i, (tp, extra, full) in enumerate(legs):
        model, opt, train_step, sl = start("gpt", 1, tp, extra)
        saved = f"{folder}/{name}{i - 1}.pt"
        if i and legs[i - 1][2]:  # the plain model's and optimizer's state dicts
            model_sd, opt_sd = torch.load(saved, weights_only=True)
            model.load_state_dict(model_sd)
            opt.load_state_dict(opt_sd)
        elif i:
            smp.resume_from_checkpoint(folder, tag=f"{name}{i - 1}")
        for x, y in data[:2] if i == 0 else data[i + 1:i + 2]:
            opt.zero_grad()
            train_step(model, x[sl], y[sl])
            opt.step()
        if i + 1 < len(legs) and full:
            both = (model.state_dict(), opt.state_dict())  # collectives: every rank
            if dist.get_rank() == 0:
                torch.save(both, f"{folder}/{name}{i}.pt")
            dist.barrier()
        elif i + 1 < len(legs):
            smp.save_checkpoint(folder, f"{name}{i}", model=model, optimizer=opt)
    return _state_differs(f"chain {name}", model.state_dict(), ref_state)


def run_precision(name: str, path: str) -> dict[str, Any]:
    """One precision case on this rank: its losses, overflows and what differs."""
    tp, extra, opt_args, tol = PRECISION[name]
    losses, overflows, ref_state = torch.load(path, weights_only=True)
    model, opt, train_step, sl = start("gpt", 1, tp, extra, opt_args)
    got, skipped = [], []
    for x, y in batches("gpt"):
        opt.zero_grad()
        out = train_step(model, x[sl], y[sl]).reduce_mean().detach().float()
        dist.all_reduce(out)  # every rank's loss: the global batch's (tp ranks alike)
        got.append(float(out) / dist.get_world_size())
        opt.step()
        skipped.append(opt.overflow)
    bad = [f"{name}: loss step {i} {a} vs {b}" for i, (a, b) in enumerate(zip(got, losses))
           if abs(a - b) > 1e-3 * abs(b)]
    if skipped != overflows:
        bad.append(f"{name}: overflows {skipped} vs {overflows}")
    half = torch.float16 if extra.get("fp16") else torch.bfloat16
    pairs = opt._masters.pairs  # (model parameter, its fp32 master) of this rank's shards
    sharded = [(p, m) for p, m in pairs if hasattr(p, "full_tensor")]
    if not sharded or not all(p.dtype == half and m.dtype == torch.float32 and
                              hasattr(m, "full_tensor") for p, m in sharded):
        bad.append(f"{name}: not {half} shards with fp32 master shards")
    full = {k: v.float() for k, v in model.state_dict().items()}
    ref = {k: v.float() for k, v in ref_state.items()}
    bad += [f"{name}: state_dict {n} {_diff(full[n], ref[n])}"
            for n in mismatched(full, ref, atol=tol, rtol=tol)]
    return {"bad": bad, "skipped": skipped}


def precision_reference(name: str) -> tuple[list[float], list[bool], dict[str, torch.Tensor]]:
    """One smp-fx process under the same precision (no sharding, no tp) on the global
    batch: each step's loss and overflow, the final ``state_dict()``."""
    _, extra, opt_args, _ = PRECISION[name]
    half = {k: v for k, v in extra.items() if k in ("fp16", "bf16")}
    from smp_fx.world import state

    try:
        model, opt, train_step, _ = start("gpt", 1, 1, half, opt_args)
        losses, overflows = [], []
        for x, y in batches("gpt"):
            opt.zero_grad()
            losses.append(float(train_step(model, x, y).reduce_mean()))
            opt.step()
            overflows.append(opt.overflow)
        return losses, overflows, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        state._reset()


def _state_differs(tag: str, full: dict[str, Any], ref_state: dict[str, Any]) -> list[str]:
    bad = [] if list(full) == list(ref_state) else [
        f"{tag}: state_dict keys {sorted(set(full) ^ set(ref_state))[:4]}"]
    return bad + [f"{tag}: state_dict {n} {_diff(full[n], ref_state[n])}"
                  for n in mismatched(full, ref_state, **TOL)]


def _diff(a: torch.Tensor, b: Any) -> str:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return f"shape {tuple(a.shape)}"
    return f"{(a.float() - b.float()).abs().max().item():.1e}"


def _guarded(tag: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or a mismatch naming ``tag`` and the error: the next cases still run."""
    try:
        return fn(*args)
    except Exception:
        return [f"{tag}: {traceback.format_exc()}"]


def _body(cases: Any, paths: dict[str, str], chains: tuple[str, ...] = (),
          precisions: tuple[str, ...] = ()) -> dict[str, Any]:
    dist.init_process_group("gloo")
    bad: list[str] = []
    for kind, pp, tp, extra in cases:
        bad += _guarded(f"{kind} tp{tp} {sorted(extra)}", run_case, kind, pp, tp, extra,
                        paths[f"{kind}{clip_of(extra)}"])
    folder = _shared_dir() if chains else ""
    for name in chains:
        bad += _guarded(f"chain {name}", run_chain, name, paths[f"chain {name}"], folder)
    skipped = {}
    for name in precisions:
        out = _guarded(name, run_precision, name, paths[name])
        if isinstance(out, list):
            bad += out
            continue
        bad += out["bad"]
        skipped[name] = out["skipped"]
    return {"bad": bad, "skipped": skipped}


def _references(cases: Any, tmp_path: Any, chains: tuple[str, ...] = (),
                precisions: tuple[str, ...] = ()) -> dict[str, str]:
    """The reference runs the cases need, by file (too many tensors to hand to ranks)."""
    runs: dict[str, Any] = {}
    for kind, clip in sorted({(c[0], clip_of(c[3])) for c in cases}, key=str):
        runs[f"{kind}{clip}"] = lambda kind=kind, clip=clip: reference(kind, clip)
    for name in chains:
        legs = len(CHAINS[name])
        runs[f"chain {name}"] = lambda n=legs: reference("gpt", None, n + 1)
    for name in precisions:
        runs[name] = lambda name=name: precision_reference(name)
    paths = {}
    for key, run in runs.items():
        paths[key] = str(tmp_path / f"{key.replace(' ', '_')}.pt")
        torch.save(run(), paths[key])
    return paths


@pytest.mark.multiproc
def test_tp_with_zero1_and_sdp_on_four_ranks(tmp_path: Any) -> None:
    chains, precisions = tuple(CHAINS), tuple(PRECISION)
    paths = _references(FOUR, tmp_path, chains, precisions)
    results = run_ranks(_body, 4, FOUR, paths, chains, precisions, timeout=500,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    assert [r["bad"] for r in results] == [[]] * 4, [r["bad"] for r in results if r["bad"]]
    assert results[0]["skipped"]["fp16"][0] and not any(results[0]["skipped"]["fp16"][1:])
    assert all(r["skipped"] == results[0]["skipped"] for r in results)


@pytest.mark.multiproc
def test_pp_tp_sdp_on_eight_ranks(tmp_path: Any) -> None:
    results = run_ranks(_body, 8, EIGHT, _references(EIGHT, tmp_path), timeout=400,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    assert [r["bad"] for r in results] == [[]] * 8, [r["bad"] for r in results if r["bad"]]
