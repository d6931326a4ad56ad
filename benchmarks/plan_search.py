"""The CPU seconds of ``smp-fx plan``'s searches of docs/planning.md's ep / cp table.

For each row (Mixtral-8x7B at 4096 tokens on 64, 256, 1024 H100s; DeepSeek-V3 on 256 and
1024; Llama-3-70B at 32K tokens on 256 and 1024; global batch 1024, 512 for Llama) it
prepares the config once, runs the search as ``smp-fx plan --top 3`` does and prints this
process's CPU seconds (on a shared machine the wall time measures the neighbours too),
the candidates priced and the best plan. ``--json FILE`` writes every row's ranked plans
(``--top`` of them, step and memory to the float) to compare two versions of the search.

    .venv/bin/python benchmarks/plan_search.py [--rows mixtral-8x7b:64,...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cost_model.cluster import load_cluster
from smp_fx.planner.hf_config import prepare_config
from smp_fx.planner.model import Prepared
from smp_fx.planner.planner import plan
from smp_fx.planner.step import Setting

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
ROWS = (("mixtral-8x7b", 4096, 64, 1024), ("mixtral-8x7b", 4096, 256, 1024),
        ("mixtral-8x7b", 4096, 1024, 1024), ("deepseek-v3", 4096, 256, 1024),
        ("deepseek-v3", 4096, 1024, 1024), ("llama3-70b", 32768, 256, 512),
        ("llama3-70b", 32768, 1024, 512))
"""(config, tokens per sample, GPUs, global batch)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="config:gpus,... (default: every row)")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    wanted = {tuple(r.split(":")) for r in args.rows.split(",") if r}
    cluster = load_cluster("dgx-h100")
    prepared: dict[tuple[str, int], Prepared] = {}
    out = []
    for name, tokens, gpus, batch in ROWS:
        if wanted and (name, str(gpus)) not in wanted:
            continue
        if (name, tokens) not in prepared:
            prepared[(name, tokens)] = prepare_config(CONFIGS / f"{name}.json", tokens)
        setting = Setting(cluster, gpus, batch, "bf16", 1.0, step_temporary=True)
        cpu = time.process_time()
        planned = plan(prepared[(name, tokens)], setting, top_k=args.top)
        cpu = time.process_time() - cpu
        best = planned.best
        print(f"{name:13s} {gpus:5d} GPUs: {cpu:6.1f} CPU s, "
              f"{planned.result.considered:7,d} priced, {planned.result.fitting:6,d} fit, "
              f"{planned.result.stepped:6,d} steps, {planned.result.profiles:3d} part "
              f"pricings; {best.candidate.label()}: {best.step_time_s:.4f} s, "
              f"{best.memory_bytes_per_gpu / 1024**3:.1f} GiB", flush=True)
        out.append({"config": name, "gpus": gpus, "cpu_s": cpu,
                    "considered": planned.result.considered,
                    "fitting": planned.result.fitting, "stepped": planned.result.stepped,
                    "ranked": [[p.candidate.label(), p.step_time_s, p.memory_bytes]
                               for p in planned.result.ranked]})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
