"""End-to-end ``smp-fx partition`` on a GPT-2-XL-size model built on the meta device.

48 layers, hidden 1600, 25 heads, vocab 50257, sequence 1024 (about 1.6 B parameters, no
weight memory: ``--meta``). Target: under 30 s on a laptop-class CPU. Prints the seconds
of each phase and the total, plus the plan's summary line.

    .venv/bin/python benchmarks/cli_gpt2xl.py [--partitions 8] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import io
import resource
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch

from smp_fx.cli.partition import main

ROOT = Path(__file__).resolve().parents[1]
GPT2_XL = ("n_layer=48", "n_embd=1600", "n_head=25", "vocab_size=50257", "seq_len=1024")
TARGET_S = 30.0


def run(partitions: int, microbatches: int, compare: bool, out_dir: Path | None) -> float:
    argv = [str(ROOT / "examples" / "models" / "gpt.py"), "--meta",
            *(a for kv in GPT2_XL for a in ("--build-arg", kv)),
            "--inputs-arg", "seq_len=1024", "--partitions", str(partitions),
            "--microbatches", str(microbatches), "--batch-size", str(microbatches)]
    if compare:
        argv.append("--compare")
    if out_dir is not None:
        argv += ["--json", str(out_dir / "gpt2xl_plan.json"), "--timeline",
                 str(out_dir / "gpt2xl_timeline.png"), "--dot", str(out_dir / "gpt2xl.dot")]
    buf = io.StringIO()
    t0 = time.perf_counter()
    with redirect_stdout(buf):
        code = main(argv)
    elapsed = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"smp-fx partition failed with exit status {code}")
    print(buf.getvalue())
    return elapsed


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--out", type=Path, help="also write plan JSON, dot and timeline here")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    seconds = run(args.partitions, args.microbatches, args.compare, args.out)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    verdict = "OK" if seconds < TARGET_S else "OVER TARGET"
    print(f"cli_gpt2xl: {seconds:.2f} s end to end (target < {TARGET_S:.0f} s: {verdict}), "
          f"peak RSS {rss:.0f} MiB, {args.partitions} partitions, "
          f"{args.microbatches} microbatches")


if __name__ == "__main__":
    cli()
