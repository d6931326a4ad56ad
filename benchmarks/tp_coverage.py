"""Tensor parallelism over Hugging Face architectures: how much is sharded, and is it right.

For each tiny model of ``examples/models/hf_zoo.py`` (27 architectures, built from configs,
marked whole; GPT-2, BERT and RoBERTa as Hugging Face builds them, not SMP's replacements):

* the share of parameter elements sharded at tensor-parallel degree 2 and 4 (the plan's
  coverage report, as ``smp-fx partition`` prints it), with the column -> row pairs, lone
  linears and replicated linears or embeddings at degree 2;
* whether training at ``tensor_parallel_degree: 2`` on 2 gloo processes through the SMP
  API (``prescaled_batch: true``, ``ddp: true``; ``--steps`` steps of ``--optimizer``,
  default Adam) gives the full ``state_dict()`` of one process training the plain model on
  the same batch, at ``--tol`` (1e-5). The largest difference and the parameter it is in
  are printed.

    python benchmarks/tp_coverage.py                       # every architecture, ~10 min
    python benchmarks/tp_coverage.py --archs opt,t5 --optimizer sgd
    python benchmarks/tp_coverage.py --no-train            # coverage only, ~2 min
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.models import hf_zoo  # noqa: E402

GLOBAL_BATCH = 4


def _optimizer(params: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.Adam(params, lr=args.lr, eps=args.eps)


def _batches(name: str, steps: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    torch.manual_seed(1234)
    return [(hf_zoo.inputs(name, GLOBAL_BATCH), hf_zoo.targets(name, GLOBAL_BATCH))
            for _ in range(steps)]


def coverage(name: str, degree: int, attention: str) -> Any:
    """The tensor-parallel plan's coverage at ``degree`` (rank 0's plan, as the CLI's)."""
    from cost_model.devices import get_device
    from passes.pipeline import compile_model
    from passes.tensor_parallel.coverage import coverage as report
    from smp_fx.config import load_config
    from smp_fx.marking.tensor_parallelism import rewrite_inputs

    model = hf_zoo.build(name, attention=attention)
    cfg = load_config({"pipeline_parallel_degree": 1, "tensor_parallel_degree": degree,
                       "ddp": True, "prescaled_batch": True}, env={})
    compiled = compile_model(model, hf_zoo.inputs(name, 2), {}, cfg.partition_config("a100"),
                             device=get_device("a100"), tp=rewrite_inputs(cfg, 0, model))
    assert compiled.tp_plan is not None
    return report(compiled.tp_plan)


def reference(name: str, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """One process, the plain model, the global batch: the state dict after the steps."""
    model = hf_zoo.build(name, marked=False, attention=args.attention)
    opt = _optimizer(model.parameters(), args)
    for x, y in _batches(name, args.steps):
        opt.zero_grad()
        hf_zoo.loss_fn(model(*x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(args: argparse.Namespace) -> None:
    """Runs under ``smp-fx run -n 2``: each architecture at tp=2; rank 0 saves its
    ``state_dict()`` (the full model's) for the parent to compare."""
    import smp_fx as smp

    torch.set_num_threads(1)
    for name in args.archs.split(","):
        smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
                  "prescaled_batch": True, "microbatches": 1, "optimize": args.optimize})
        model = smp.DistributedModel(hf_zoo.build(name, attention=args.attention))
        opt = smp.DistributedOptimizer(_optimizer(model.parameters(), args))

        @smp.step
        def train_step(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
            loss = hf_zoo.loss_fn(model(*x), y)
            model.backward(loss)
            return loss

        for step, (x, y) in enumerate(_batches(name, args.steps)):
            opt.zero_grad()
            train_step(model, x, y)
            if step == 0 and args.grads:
                grads = _full_grads(model)
                if smp.rank() == 0:
                    torch.save(grads, Path(args.out) / f"{name}.grad.pt")
            opt.step()
        state = model.state_dict()
        if smp.rank() == 0:
            torch.save({k: v.detach().cpu() for k, v in state.items()},
                       Path(args.out) / f"{name}.pt")
        smp.reset()


def _full_grads(model: Any) -> dict[str, torch.Tensor]:
    """The model's first-step gradients, shards all-gathered over tp and merged."""
    import torch.distributed as dist

    import smp_fx as smp
    from passes.tensor_parallel import merge_shards

    out = {}
    for name, p in model.local_named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        spec = model.tp_plan.shard_spec(name)
        if spec is not None:
            parts = [torch.empty_like(g) for _ in range(spec.parts)]
            dist.all_gather(parts, g.contiguous(), group=smp.get_tp_process_group())
            g = merge_shards(spec, parts)
        out[name] = g.detach().cpu()
    return out


def first_grads(name: str, attention: str) -> dict[str, torch.Tensor]:
    """One process's first-step gradients on the plain model."""
    model = hf_zoo.build(name, marked=False, attention=attention)
    x, y = _batches(name, 1)[0]
    hf_zoo.loss_fn(model(*x), y).backward()
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def grad_notes(name: str, attention: str, grads: dict[str, torch.Tensor], worst: str,
               ref_state: dict[str, torch.Tensor], got_state: dict[str, torch.Tensor]) -> str:
    """The largest first-step gradient difference (before any optimizer step) and, at the
    entry of the largest final difference, the size of that entry's first gradient."""
    ref = first_grads(name, attention)
    diff = max(((ref[k] - grads[k]).abs().max().item(), k) for k in ref if k in grads)
    note = f"grad diff {diff[0]:.1e} ({diff[1]})"
    if worst in ref:
        at = (ref_state[worst].float() - got_state[worst].float()).abs().argmax()
        note += f"; |grad| at the worst entry {ref[worst].flatten()[at].abs().item():.1e}"
    return note


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: float
            ) -> tuple[bool, float, str]:
    """(equal at ``tol``, the largest absolute difference, the name it is in)."""
    if list(ref) != list(got):
        return False, float("inf"), f"keys differ: {sorted(set(ref) ^ set(got))[:3]}"
    worst, where, ok = 0.0, "", True
    for k, v in ref.items():
        if v.shape != got[k].shape:
            return False, float("inf"), f"{k} shape {tuple(got[k].shape)}"
        diff = (v.float() - got[k].float()).abs().max().item() if v.numel() else 0.0
        ok = ok and torch.allclose(got[k].float(), v.float(), atol=tol, rtol=tol)
        if diff > worst:
            worst, where = diff, k
    return ok, worst, where


def _quiet() -> None:
    """Only errors from the libraries (the tiny configs' token ids and the cost model's
    ops without a formula are expected here)."""
    import transformers

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(hf_zoo.ARCHITECTURES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eps", type=float, default=1e-8, help="Adam's eps")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--optimize", choices=("speed", "memory"), default="memory",
                    help="SMP's optimize: memory chunks the activations between the pairs "
                         "by sequence")
    ap.add_argument("--no-train", action="store_true", help="coverage only")
    ap.add_argument("--lone", action="store_true", help="also list the lone linears")
    ap.add_argument("--grads", action="store_true",
                    help="also compare the first step's gradients (before the optimizer) "
                         "and show the first gradient at the worst final entry")
    ap.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                    help="the models' attention implementation (sdpa: transformers' "
                    "default, where a model has it)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _quiet()
    if args.worker:
        worker(args)
        return
    t0 = time.perf_counter()
    names = args.archs.split(",")
    rows: dict[str, list[Any]] = {}
    for name in names:
        two, four = coverage(name, 2, args.attention), coverage(name, 4, args.attention)
        rows[name] = [two, four]
        for module, why in two.replicated + (two.lone if args.lone else ()):
            print(f"  {name}: {'replicated' if (module, why) in two.replicated else 'lone'} "
                  f"{module}: {why}", flush=True)
    results: dict[str, tuple[bool, float, str]] = {}
    notes: dict[str, str] = {}
    if not args.no_train:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", __file__,
                   "--worker", f"--out={out}", f"--archs={args.archs}",
                   f"--attention={args.attention}",
                   f"--steps={args.steps}", f"--optimizer={args.optimizer}",
                   f"--lr={args.lr}", f"--eps={args.eps}", f"--optimize={args.optimize}"
                   ] + (["--grads"] if args.grads else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                     "SMP_FX_DEVICE_SPEC": "a100"})
            for name in names:
                path = Path(out) / f"{name}.pt"
                if not path.exists():
                    results[name] = (False, float("inf"), "the tp=2 run did not finish")
                    continue
                got = torch.load(path, weights_only=True)
                ref = reference(name, args)
                results[name] = compare(ref, got, args.tol)
                if args.grads:
                    grads = torch.load(Path(out) / f"{name}.grad.pt", weights_only=True)
                    notes[name] = grad_notes(name, args.attention, grads, results[name][2],
                                             ref, got)
            if proc.returncode != 0:
                print(f"the tp=2 run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    opt = args.optimizer if args.optimizer == "sgd" else f"adam eps={args.eps:g}"
    print(f"\ntensor parallelism over {len(names)} Hugging Face architectures (2 layers, "
          f"hidden {hf_zoo.HIDDEN}); training: tp=2 on 2 gloo processes vs 1 process, "
          f"{args.steps} steps of {opt} lr={args.lr:g}, full state_dict at {args.tol:g}")
    print(f"{'architecture':<13} {'tp=2':>6} {'tp=4':>6} {'pairs':>5} {'lone':>4} "
          f"{'repl':>4}  {'numerics (max |diff|, where)'}")
    for name in names:
        two, four = rows[name]
        num = ""
        if name in results:
            ok, worst, where = results[name]
            num = f"{'equal' if ok else 'DIFFER'} {worst:.1e} {where}"
        print(f"{name:<13} {two.share:>6.3f} {four.share:>6.3f} {two.pairs:>5} "
              f"{len(two.lone):>4} {len(two.replicated):>4}  {num}")
        if name in notes:
            print(f"{'':<13} {notes[name]}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
