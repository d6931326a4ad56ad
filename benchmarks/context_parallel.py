"""Context parallelism: the balance of causal attention, activations per rank, step time.

1. Causal attention FLOPs per rank at cp 4 (sequence 32768, 32 heads of 128): the balanced
   chunks (rank r holds chunks r and 2cp - 1 - r) beside a contiguous split. Target: the
   ranks within 5 % of each other. Analytic (the (query, key) pairs each rank computes).
2. Bytes saved for backward per rank, Hugging Face Llama from a tiny config at sequence
   512, cp 1 and cp 2 on 2 gloo processes: measured (saved-tensor hooks on one forward of
   the rewritten graph, parameters excluded) beside the cost model's prediction (the
   rewritten graph's ``saved_bytes``). Expected: cp 2 about half of cp 1.
3. Forward + backward of that model, cp 1 (one process) beside cp 2 (two): a figure.
4. The logits gathered or left local (``context_parallel_local_outputs``) at cp 2: that
   tiny Llama with a 32000-token vocabulary (Llama 2's), sequence 512, its loss computed
   after the model (``smp.cp_mean`` of the local tokens' sum when local): bytes saved for
   backward by the model and the loss (the loss's log-softmax of the logits among them)
   plus the logits themselves, per rank, beside the memory model's outputs term.

Run: ``.venv/bin/python benchmarks/context_parallel.py``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_model.devices import H100  # noqa: E402
from cost_model.measure import SavedCounter, saved_bytes_by_module  # noqa: E402
from passes import axis_groups, meta  # noqa: E402
from passes.context_parallel import collectives, context_parallel  # noqa: E402
from passes.pipeline import analyse  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402

SEQ, HEADS, HEAD_DIM, CP = 32768, 32, 128, 4
TINY_SEQ, BIG_VOCAB = 512, 32000


def attention_flops(rows: torch.Tensor) -> float:
    """Forward FLOPs of causal attention for queries at positions ``rows`` (QK^T and PV)."""
    return float(4 * HEADS * HEAD_DIM * int((rows + 1).sum()))


def balance() -> None:
    chunk = SEQ // CP
    for name, rows in (("balanced", [collectives.local_index(SEQ, CP, r) for r in range(CP)]),
                       ("contiguous", [torch.arange(r * chunk, (r + 1) * chunk)
                                       for r in range(CP)])):
        flops = [attention_flops(r) for r in rows]
        spread = (max(flops) - min(flops)) / max(flops)
        print(f"  {name:10s} per rank TFLOP: "
              + "  ".join(f"{f / 1e12:7.2f}" for f in flops) + f"   spread {spread:6.1%}")


def _tiny(vocab: int | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    from examples.models import hf_zoo

    spec = hf_zoo.ARCHITECTURES["llama"]
    config = transformers.LlamaConfig(**{**spec.kwargs, "max_position_embeddings": TINY_SEQ,
                                         "vocab_size": vocab or hf_zoo.VOCAB})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = hf_zoo.Logits(transformers.LlamaForCausalLM(config), "lm")
    return model, torch.randint(0, hf_zoo.VOCAB, (1, TINY_SEQ))


def _rank(degree: int) -> dict[str, Any]:
    import torch.distributed as dist

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if degree > 1:
        dist.init_process_group("gloo")
        axis_groups.bind("cp", dist.group.WORLD, degree, dist.get_rank())
    model, ids = _tiny()
    costed = analyse(model, (ids,), {}, device=H100, frontend="export")
    gm, _ = context_parallel(costed, degree)
    predicted = sum(meta.COST.get(n).saved_bytes for n in gm.graph.nodes
                    if meta.COST.get(n) is not None)
    measured = sum(saved_bytes_by_module(gm, (ids,)).values())
    times = []
    for _ in range(4):
        start = time.perf_counter()
        gm(ids).float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return {"predicted": predicted, "measured": measured,
            "step_s": statistics.median(times[1:])}


def activations() -> None:
    one = run_ranks(_rank, 1, 1, timeout=600)[0]
    two = run_ranks(_rank, 2, 2, timeout=600)
    print(f"  {'':6s} {'measured B':>12s} {'predicted B':>12s} {'fwd+bwd s':>10s}")
    print(f"  cp 1   {one['measured']:12d} {one['predicted']:12d} {one['step_s']:10.3f}")
    for r, got in enumerate(two):
        print(f"  cp 2/{r} {got['measured']:12d} {got['predicted']:12d} {got['step_s']:10.3f}")
    ratio = statistics.mean(g["measured"] for g in two) / one["measured"]
    print(f"  cp 2 / cp 1 measured saved bytes per rank: {ratio:.3f}")


def _outputs_rank(local: bool) -> dict[str, int]:
    """Bytes this cp rank holds for backward through the model and the loss, and the
    logits' bytes, with the logits gathered or left local."""
    import torch.distributed as dist
    from torch.nn import functional as F

    logging.getLogger("transformers").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    axis_groups.bind("cp", dist.group.WORLD, 2, dist.get_rank())
    model, ids = _tiny(BIG_VOCAB)
    targets = torch.randint(0, BIG_VOCAB, ids.shape)
    costed = analyse(model, (ids,), {}, device=H100, frontend="export")
    gm, _ = context_parallel(costed, 2, local_outputs=local)
    counter = SavedCounter([*gm.parameters(), *gm.buffers()])
    with counter.hooks():
        logits = gm(ids)
        if local:
            mine = targets[:, collectives.query_positions(TINY_SEQ, ids.device)]
            total = F.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum")
            loss = collectives.cp_sum(total) / TINY_SEQ
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return {"saved": counter.total, "logits": logits.untyped_storage().nbytes()}


def local_outputs() -> None:
    from cost_model.memory import memory_per_gpu

    logits = TINY_SEQ * BIG_VOCAB * 4
    print(f"  {'':14s} {'saved B':>12s} {'logits B':>12s} {'sum B':>12s} {'model outputs B':>16s}")
    for local in (False, True):
        ranks = run_ranks(_outputs_rank, 2, local, timeout=600)
        term = memory_per_gpu(elems=0, buffers=0, kept=0, in_flight=1, transient=0,
                              precision="fp32", zero="none", dp=1, layer_elems=0, boundary=0,
                              output_bytes=logits, pipelined=False, cp=2,
                              local_outputs=local).outputs
        for r, got in enumerate(ranks):
            name = f"{'local' if local else 'gathered'} rank {r}"
            print(f"  {name:14s} {got['saved']:12d} {got['logits']:12d} "
                  f"{got['saved'] + got['logits']:12d} {term:16d}")


def main() -> None:
    print(f"causal attention at cp {CP}, sequence {SEQ}, {HEADS} heads of {HEAD_DIM}:")
    balance()
    print(f"tiny Llama, sequence {TINY_SEQ}, batch 1: bytes saved for backward per rank")
    activations()
    print(f"tiny Llama, vocabulary {BIG_VOCAB}, sequence {TINY_SEQ}, batch 1, cp 2: the "
          "logits gathered or left local, bytes per rank")
    local_outputs()


if __name__ == "__main__":
    main()
