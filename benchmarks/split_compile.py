"""A split backward's compiled stage, two ways, beside its eager run: one process, one stage.

The Hugging Face Llama example (``examples/models/hf_llama.py``) cut in two stages by the
automatic partitioner; its second stage (decoder layers and the head: it receives
gradients) runs a microbatch's forward, I and W (``StageRunner.backward_input`` /
``backward_weight``) three ways, round-robin so the machine's load hits all alike:

- eager: the stage as it is, I and W from its autograd graph (``split_backward``);
- regions: compiled between its eager GEMMs (``compile_in_regions``);
- deferred: compiled whole with its GEMMs' weight gradients deferred to W
  (``compile_deferred``, the default for such a stage).

Each is checked against the eager gradients first; then the median of ``--rounds`` timed
microbatches each, and the ratios. One intra-op thread.

    python benchmarks/split_compile.py [--backend inductor] [--layers 4] [--hidden 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stage(layers: int, hidden: int, batch: int, seq: int) -> tuple[Any, list[Any]]:
    """The second stage's GraphModule and its inputs (the first stage run once)."""
    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from passes.split_stages import split_stages
    from smp_fx.cli.partition import load_model_file

    ex = load_model_file(str(Path(__file__).resolve().parents[1] / "examples/models/hf_llama.py"))
    torch.manual_seed(0)
    model = ex.build_model(num_hidden_layers=layers, hidden_size=hidden, seq_len=seq)
    ids = torch.randint(0, 64, (batch, seq))
    compiled = compile_model(model, (ids,), None, PartitionConfig(num_stages=2))
    prog = split_stages(compiled.gm, 2)
    first, second = prog.stages
    inputs = prog.bind_inputs((ids,), {})
    env = dict(zip(first.output_names, first.module(*[inputs[n] for n in first.input_names])))
    vals = [inputs[n] if n in second.program_inputs else env[n] for n in second.input_names]
    return second, [v.detach().requires_grad_(v.is_floating_point())
                    if isinstance(v, torch.Tensor) else v for v in vals]


def _runner(stage: Any, how: str, backend: str) -> Any:
    from smp_fx.runtime.executor.compiled import (
        CompileStats,
        compile_deferred,
        compile_in_regions,
    )
    from smp_fx.runtime.executor.seams import StageRunner

    runner = StageRunner(stage, torch.device("cpu"))
    stats = CompileStats(stage.index)
    reason = {"eager": lambda: None,
              "regions": lambda: compile_in_regions(runner, backend, stats),
              "deferred": lambda: compile_deferred(runner, backend, stats)}[how]()
    assert reason is None, reason
    return runner


def _microbatch(runner: Any, inputs: list[Any], grads: list[torch.Tensor]) -> dict[str, Any]:
    """One forward, I and W; the parameters' and inputs' gradients."""
    for p in runner.stage.module.parameters():
        p.grad = None
    outs = [o for o in runner.forward(inputs, 0) if isinstance(o, torch.Tensor)]
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    got, pending = runner.backward_input(outs, grads, tensors, 0)
    runner.backward_weight(pending, 0)
    return {**{n: p.grad for n, p in runner.stage.module.named_parameters()},
            **{f"input {i}": g for i, g in enumerate(got)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    stage, inputs = _stage(args.layers, args.hidden, args.batch, args.seq)
    ways = ("eager", "regions", "deferred")
    runners = {how: _runner(stage, how, args.backend) for how in ways}
    outs = [o for o in runners["eager"].forward(inputs, 0) if isinstance(o, torch.Tensor)]
    grads = [torch.randn_like(o) for o in outs]
    want = _microbatch(runners["eager"], inputs, grads)
    for how in ways[1:]:
        start = time.perf_counter()
        got = _microbatch(runners[how], inputs, grads)  # compiles
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=f"{how} {name}")
        print(f"{how}: equals eager; first microbatch {time.perf_counter() - start:.1f} s")
    times: dict[str, list[float]] = {how: [] for how in ways}
    for r in range(args.rounds):
        for how in ways[r % 3:] + ways[:r % 3]:
            start = time.perf_counter()
            _microbatch(runners[how], inputs, grads)
            times[how].append(time.perf_counter() - start)
    med = {how: statistics.median(ts) * 1e3 for how, ts in times.items()}
    print(f"\nstage 1 of 2 of hf_llama ({args.layers} layers, hidden {args.hidden}, batch "
          f"{args.batch} x {args.seq}), backend {args.backend}: forward + I + W, median of "
          f"{args.rounds} round-robin microbatches")
    for how in ways:
        print(f"{how:<9} {med[how]:7.2f} ms   / eager {med[how] / med['eager']:.2f}")
    print(f"deferred / regions {med['deferred'] / med['regions']:.2f}")


if __name__ == "__main__":
    main()
