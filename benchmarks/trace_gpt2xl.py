"""Trace and cost a GPT-2-XL-size model on the meta device: time and peak memory.

Targets: under 20 s and under 2 GiB peak RSS (the fp32 weights alone would be ~6.4 GB).
Run: ``.venv/bin/python benchmarks/trace_gpt2xl.py [--layers 48] [--batch 1]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_model.devices import get_device  # noqa: E402
from examples.models import load  # noqa: E402
from passes.annotate_costs import annotate_costs  # noqa: E402
from passes.meta import COST  # noqa: E402
from passes.shape_prop import shape_prop  # noqa: E402
from passes.trace import trace  # noqa: E402
from smp_fx.marking.delayed_init import delay_param_initialization  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="h100")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    gpt = load("gpt")
    cfg = dict(n_layer=opts.layers, n_embd=1600, n_head=25, vocab_size=50257, seq_len=1024)
    t0 = time.perf_counter()
    with delay_param_initialization():
        model = gpt.build_model(**cfg)
    input_ids = torch.zeros(opts.batch, cfg["seq_len"], dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    gm = trace(model, (input_ids,))
    t2 = time.perf_counter()
    gm = shape_prop(gm, (input_ids,))
    t3 = time.perf_counter()
    gm = annotate_costs(gm, get_device(opts.device))
    t4 = time.perf_counter()
    costs = [COST.get(n) for n in gm.graph.nodes]
    params = sum(c.param_bytes for c in costs)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(f"GPT-2-XL config {cfg}, batch {opts.batch}, frontend {gm.meta['smp.frontend']}")
    print(f"nodes: {len(gm.graph.nodes)}")
    print(f"build {t1 - t0:.2f} s, trace {t2 - t1:.2f} s, shape_prop {t3 - t2:.2f} s, "
          f"annotate_costs {t4 - t3:.2f} s, total {t4 - t0:.2f} s")
    print(f"parameter bytes: {params / 1e9:.3f} GB (model: {expected / 1e9:.3f} GB, "
          f"{'equal' if params == expected else 'MISMATCH'})")
    print(f"fwd FLOPs {sum(c.fwd_flops for c in costs):.3e}, bwd FLOPs "
          f"{sum(c.bwd_flops for c in costs):.3e}, saved activations "
          f"{sum(c.saved_bytes for c in costs) / 1e9:.3f} GB, unknown ops "
          f"{sorted({c.op for c in costs if not c.known})}")
    print(f"predicted step time on {opts.device}: {sum(c.time_s for c in costs) * 1e3:.1f} ms")
    print(f"peak RSS: {peak_rss / 2**30:.3f} GiB")
    ok = t4 - t0 < 20 and peak_rss < 2 * 2**30
    print("targets (< 20 s, < 2 GiB):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
