"""``smp-fx partition`` on a GPT-2-XL-size Hugging Face model built on the meta device.

The model file is what an HF or accelerate user writes for a big model: ``GPT2LMHeadModel``
(48 layers, hidden 1600, 25 heads, vocab 50257, 1024 positions: about 1.6 B parameters)
built under ``with torch.device("meta")``, with CPU example inputs. The CLI runs as its own
process (the console script), so its wall time and peak RSS are its alone. Targets: under
20 s and under 2 GiB peak RSS (the fp32 weights alone would be ~6.2 GiB).

    python benchmarks/meta_hf_gpt2xl.py [--partitions 8] [--seq 1024] [--layers 48]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 20.0
TARGET_RSS_GIB = 2.0

MODEL_FILE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel

SEQ = {seq}


def build_model():
    cfg = GPT2Config(n_layer={layers}, n_embd=1600, n_head=25, vocab_size=50257,
                     n_positions=1024, use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg)


def example_inputs(batch_size=1):
    return (torch.randint(0, 50257, (batch_size, SEQ)),)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    args = ap.parse_args()
    exe = Path(sys.executable).with_name("smp-fx")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "smp_fx.cli.main"]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "hf_gpt2xl_meta.py"
        model.write_text(MODEL_FILE.format(seq=args.seq, layers=args.layers))
        argv = [*cmd, "partition", str(model), "--partitions", str(args.partitions),
                "--microbatches", str(args.microbatches), "--batch-size",
                str(args.microbatches)]
        t0 = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    if result.returncode != 0:
        print(result.stderr[-3000:])
        raise SystemExit(f"smp-fx partition failed (exit {result.returncode})")
    progress = [ln for ln in result.stderr.splitlines() if ln.startswith("[")]
    print("\n".join(progress))
    print(next((ln for ln in result.stdout.splitlines() if ln.startswith("objective")), ""))
    print(f"HF GPT2LMHeadModel {args.layers} x 1600 on meta, CPU inputs (batch "
          f"{args.microbatches} x {args.seq}), {args.partitions} partitions: {wall:.1f} s "
          f"(target {TARGET_S:.0f} s), peak RSS {rss_gib:.2f} GiB (target "
          f"{TARGET_RSS_GIB:.0f} GiB)")


if __name__ == "__main__":
    main()
