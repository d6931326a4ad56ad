"""Predicted vs actual bytes saved for backward, per module, for every example model.

Predicted: the analytic cost model (``annotate_costs`` on a fake-tensor ``shape_prop``).
Actual: one real CPU forward with ``torch.autograd.graph.saved_tensors_hooks`` counting
every saved tensor, parameters excluded, deduplicated by storage, attributed to the
innermost running module (``cost_model.measure.saved_bytes_by_module``).
Target: total within 5% per model.
Run: ``.venv/bin/python benchmarks/saved_activations.py [--batch 4] [--verbose]``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_model.devices import H100  # noqa: E402
from cost_model.measure import saved_bytes_by_module  # noqa: E402
from examples.models import NAMES, load  # noqa: E402
from passes.annotate_costs import annotate_costs  # noqa: E402
from passes.meta import COST, MODULE_PATH  # noqa: E402
from passes.shape_prop import shape_prop  # noqa: E402
from passes.trace import trace  # noqa: E402


def compare(name: str, batch: int, verbose: bool) -> tuple[int, int]:
    ex = load(name)
    torch.manual_seed(0)
    model = ex.build_model()
    args = ex.example_inputs(batch)
    gm = annotate_costs(shape_prop(trace(model, args), args), H100)
    predicted: Counter[str] = Counter()
    for node in gm.graph.nodes:
        predicted[MODULE_PATH.get(node) or ""] += COST.get(node).saved_bytes
    actual = Counter(saved_bytes_by_module(model, args))
    total_p, total_a = sum(predicted.values()), sum(actual.values())
    modules = sorted(k for k in set(predicted) | set(actual) if predicted[k] or actual[k])
    off = [m for m in modules if abs(predicted[m] - actual[m]) > 0.05 * max(actual[m], 1)]
    ratio = total_p / total_a if total_a else float("nan")
    print(f"{name:8s} {gm.meta['smp.frontend']:6s} predicted {total_p:10d} B  actual "
          f"{total_a:10d} B  ratio {ratio:.4f}  modules {len(modules):3d}, "
          f"off by >5%: {len(off)}")
    for m in off if not verbose else modules:
        print(f"    {m or '<root>':60s} predicted {predicted[m]:9d}  actual {actual[m]:9d}")
    return total_p, total_a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    worst = 0.0
    for name in NAMES:
        p, a = compare(name, opts.batch, opts.verbose)
        worst = max(worst, abs(p - a) / max(a, 1))
    print(f"worst total error {worst:.2%}: target (<= 5%)", "met" if worst <= 0.05 else "NOT met")


if __name__ == "__main__":
    main()
