"""Train the GPT example under the configuration ``smp-fx plan --emit-config`` wrote.

The loop of ``docs/planning.md``: plan for N processes, write the SMP configuration, then::

    smp-fx run -n 8 --config cfg.json examples/train_planned.py --plan plan.json \\
        --global-batch 16 --reference --out figures/

It builds ``examples/models/gpt.py`` at the sizes given, marks the whole model for tensor
parallelism when the configuration has tp > 1 (the planner prices the whole model
sharded), checkpoints each layer with ``--recompute full``, feeds every replica its share
of a synthetic global batch (every rank of a tensor-parallel group the same samples, as
``prescaled_batch`` asks), pins each layer to the pipeline rank the plan gives it
(``--plan``: the configuration sets ``auto_partition`` false) and trains with Adam.
``--reference`` trains the unpartitioned model on the whole batch in plain PyTorch on
rank 0 too and compares the losses. Each rank
writes what it measured (``--out``): the median step time and the bytes it holds at its
peak, counted as the plan counts them (parameters, gradients, Adam state, and the
activations its stages keep per microbatch, counted by saved-tensor hooks, times the most
microbatches they held at once), beside its peak resident set size. ``--measure FILE``
writes the run's measurement (``smp.write_measurement``) for ``smp-fx plan --measured``.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import smp_fx as smp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models.gpt import build_model  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--recompute", choices=("none", "full"), default="none")
    ap.add_argument("--plan", type=Path,
                    help="smp-fx plan --json output: the best plan's layers per pipeline rank "
                         "and recomputation")
    ap.add_argument("--reference", action="store_true",
                    help="compare the losses with plain PyTorch on rank 0")
    ap.add_argument("--out", type=Path, help="folder for each rank's figures (JSON)")
    ap.add_argument("--measure", type=Path,
                    help="write the run's measurement (smp.write_measurement) for "
                         "smp-fx plan --measured")
    return ap.parse_args(argv)


def batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches: sequences counting up from a random start, next-token targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.steps):
        start = torch.randint(0, args.vocab_size, (args.global_batch, 1), generator=g)
        seq = (start + torch.arange(args.seq_len + 1)) % args.vocab_size
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _nbytes(t: Any) -> int:
    """Bytes this process holds of ``t`` (a sharded DTensor: its local shard)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def measured_bytes(model: Any, inner: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds, counted as the planner counts it (module docstring). Reads the
    executor's saved-tensor counters, which ``track`` turned on before the last step."""
    params = grads = state = kept = 0
    for s, keeper in model.executor.keepers.items():
        stage = model.program.stages[s]
        ps = [p for p in stage.module.parameters() if p.requires_grad]
        params += sum(_nbytes(p) for p in ps)
        grads += sum(_nbytes(p.grad) for p in ps)
        state += sum(_nbytes(t) for p in ps for t in inner.state.get(p, {}).values())
        per_mb = max((r.on_device for r in keeper.records.values()), default=0)
        kept += per_mb * model.executor.stats.peak_in_flight.get(s, 0)
    return {"params": params, "grads": grads, "optimizer": state, "activations": kept,
            "total": params + grads + state + kept}


def pin_layers(net: torch.nn.Module, per_rank: list[int]) -> None:
    """The plan's stages: layers in order, ``per_rank[r]`` of them on pipeline rank r; the
    embeddings stay on rank 0 (``default_partition``), the final norm and head go last."""
    layer = 0
    for rank, count in enumerate(per_rank):
        for _ in range(count):
            smp.set_partition(net.h[layer], rank)
            layer += 1
    smp.set_partition(net.ln_f, len(per_rank) - 1)
    smp.set_partition(net.lm_head, len(per_rank) - 1)


def reference_losses(model: torch.nn.Module, data: list[Any]) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for ids, target in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@smp.step
def train_step(model: Any, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    model.backward(loss)
    return loss


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.set_num_threads(1)
    smp.init()
    torch.manual_seed(0)
    net = build_model(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                      vocab_size=args.vocab_size, seq_len=args.seq_len)
    reference = copy.deepcopy(net) if args.reference and smp.rank() == 0 else None
    if smp.tp_size() > 1:
        smp.set_tensor_parallelism(net)
    recompute, per_rank = args.recompute, None
    if args.plan is not None:
        best = json.loads(args.plan.read_text())["best"]
        recompute, per_rank = best["recompute"], best["details"]["layers_per_rank"]
    if per_rank and smp.pp_size() > 1:
        pin_layers(net, per_rank)
    if recompute == "full":
        for block in net.h:
            smp.set_activation_checkpointing(block)
    inner = torch.optim.Adam(net.parameters(), lr=1e-3)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(inner)
    data = batches(args)
    rdp, part = smp.rdp_size(), args.global_batch // smp.rdp_size()
    lo = smp.rdp_rank() * part
    losses, times = [], []
    for i, (ids, target) in enumerate(data):
        if i == len(data) - 1:
            for keeper in model.executor.keepers.values():
                keeper.track = True
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        out = train_step(model, ids[lo:lo + part], target[lo:lo + part])
        optimizer.step()
        times.append(time.perf_counter() - t0)
        loss = out.reduce_mean().detach().clone()
        if rdp > 1:
            dist.all_reduce(loss, group=smp.get_rdp_process_group())
            loss /= rdp
        losses.append(loss.item())
    figures: dict[str, Any] = {
        "rank": smp.rank(), "pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank(),
        "rdp_rank": smp.rdp_rank(), "losses": losses,
        "step_time_s": statistics.median(times[1:] or times),
        "memory": measured_bytes(model, inner),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if args.measure is not None:
        smp.write_measurement(args.measure)
    if reference is not None:
        ref = reference_losses(reference, data)
        figures["reference_losses"] = ref
        figures["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses, ref))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{smp.rank()}.json").write_text(json.dumps(figures))
    if smp.rank() == 0:
        print(json.dumps({k: v for k, v in figures.items() if k != "reference_losses"}),
              flush=True)
    return figures


if __name__ == "__main__":
    main()
