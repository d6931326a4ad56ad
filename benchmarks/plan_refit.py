"""The planner learns from a measured run: measure 4 processes, refit, predict 8.

1. One spec for every step (``--device``; by default this machine's quick calibration,
   written once to a file so that every plan below prices with the same figures);
2. ``smp-fx plan`` for 4 processes (``--fix4``), ``smp-fx run -n 4 ...
   examples/train_planned.py --measure m4.json`` (``smp.write_measurement``);
3. the same for 8 processes (``--fix8``): its measured step is the figure to predict;
4. ``smp-fx plan --gpus 8 --fix FIX8 --measured m4.json``: the 8-process step predicted
   with the spec as it was (before) and refitted on the 4-process run (after), beside the
   measured one.

    .venv/bin/python benchmarks/plan_refit.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_loop import plan_command, train_command  # noqa: E402

FIX = "tp=1,vp=1,schedule=interleaved,zero=none,recompute=none,mbs=2"


def run(cmd: list[str]) -> str:
    print("$", " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", help="a spec file (default: this machine's quick "
                                     "calibration, written once)")
    ap.add_argument("--fix4", default=f"pp=2,dp=2,{FIX}")
    ap.add_argument("--fix8", default=f"pp=2,dp=4,{FIX}")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="plan_refit_"))
    device = args.device
    if device is None:
        from cost_model.devices import get_device

        device = str(work / "cpu.json")
        Path(device).write_text(json.dumps(get_device("cpu").to_json()))
    measured = {}
    for n, fix in ((4, args.fix4), (8, args.fix8)):
        cfg, plan_json, m = work / f"cfg{n}.json", work / f"plan{n}.json", work / f"m{n}.json"
        run(plan_command(device, n, args.global_batch, fix, cfg, plan_json))
        run(train_command(n, cfg, plan_json, args.global_batch, args.steps, "--measure",
                          str(m)))
        measured[n] = json.loads(m.read_text())
    refit_json = work / "refit.json"
    out = run([*plan_command(device, 8, args.global_batch, args.fix8, work / "cfg.json",
                             refit_json), "--measured", str(work / "m4.json")])
    print(out, flush=True)
    doc = json.loads(refit_json.read_text())
    before, after = doc["refit"]["best_before_s"], doc["best"]["step_time_s"]
    got = measured[8]["step_time_s"]
    print(f"4 processes ({args.fix4}): measured {measured[4]['step_time_s'] * 1e3:.2f} ms")
    print(f"8 processes ({args.fix8}): predicted before the refit {before * 1e3:.2f} ms "
          f"(x{before / got:.2f}), after {after * 1e3:.2f} ms (x{after / got:.2f}); "
          f"measured {got * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
