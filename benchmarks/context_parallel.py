"""Context parallelism: the balance of causal attention, activations per rank, step time.

1. Causal attention FLOPs per rank at cp 4 (sequence 32768, 32 heads of 128): the balanced
   chunks (rank r holds chunks r and 2cp - 1 - r) beside a contiguous split. Target: the
   ranks within 5 % of each other. Analytic (the (query, key) pairs each rank computes).
2. Bytes saved for backward per rank, Hugging Face Llama from a tiny config at sequence
   512, cp 1 and cp 2 on 2 gloo processes: measured (saved-tensor hooks on one forward of
   the rewritten graph, parameters excluded) beside the cost model's prediction (the
   rewritten graph's ``saved_bytes``). Expected: cp 2 about half of cp 1.
3. Forward + backward of that model, cp 1 (one process) beside cp 2 (two): a figure.

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
from cost_model.measure import saved_bytes_by_module  # noqa: E402
from passes import axis_groups, meta  # noqa: E402
from passes.context_parallel import collectives, context_parallel  # noqa: E402
from passes.pipeline import analyse  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402

SEQ, HEADS, HEAD_DIM, CP = 32768, 32, 128, 4
TINY_SEQ = 512


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


def _tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    from examples.models import hf_zoo

    spec = hf_zoo.ARCHITECTURES["llama"]
    config = transformers.LlamaConfig(**{**spec.kwargs, "max_position_embeddings": TINY_SEQ})
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


def main() -> None:
    print(f"causal attention at cp {CP}, sequence {SEQ}, {HEADS} heads of {HEAD_DIM}:")
    balance()
    print(f"tiny Llama, sequence {TINY_SEQ}, batch 1: bytes saved for backward per rank")
    activations()


if __name__ == "__main__":
    main()
