"""Compiled stages (``compile``) beside eager ones: the step, the first step's compile time
and the recompiles of varying sequence lengths, at pp 2 (and pp 1 x sdp 2) on 2 gloo
processes.

The example GPT (``examples/models/gpt.py``), the tiny Hugging Face Llama
(``examples/models/hf_llama.py``) and BERT (``examples/models/hf_bert.py``), each at pp 2
under 1F1B (``interleaved`` v = 1), interleaved v = 2 and ZB-V, and at pp 1 with sharded
data parallelism 2 (the stage compiled as one FSDP2 unit, eager in the units of SMP's
default ``sdp_*``), one intra-op thread per process, SGD. Per configuration: ``--blocks``
eager models and as many compiled ones, alternated (eager, compiled, eager, ...; each its
own ``smp.init``: one configuration per process at a time, so single steps cannot
alternate), each stepped ``--steps`` times after its first step; a block's figure is the
median over its steps, the ratio the median over blocks of each compiled block over the
eager one before it (an eager block then a compiled one, not alternated, read the GPT
example's compiled step 1.13-1.21 of eager where alternated blocks read a median of
0.94-1.02 over the same day's runs: the machine drifts between blocks). The first step's
compile time is the first compiled model's first step less its median step. Then the last
compiled model steps once at each of 5 other sequence lengths: the recompiles that adds
(summed over the stages of both ranks; dynamo makes the dimension dynamic at the first new
length) and how many stages run eagerly; then each stage's line: compiled whole (under ZB-V
the chunks that receive gradients with their GEMMs' weight gradients deferred to W), in
regions, or eagerly with the reason.

Beside it, the compiled model (the GPT with its LM head untied: torch's stages do not sum a
tied weight's gradients over the stages holding it, which smp-fx does with an all-reduce
at the end of the step) against torch.distributed.pipelining's counterpart schedule
(``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``) built from the
same chunk GraphModules, placed alike and compiled the same way (``torch.compile``, the
same backend, ``fullgraph``): one training step each (no optimizer step), the two
alternating, the fastest of ``--retries`` and the median of the paired ratios. torch
refuses its zero-bubble schedules with compiled stages, and passes each chunk's outputs to
the next chunk only: such rows print torch's reason instead of a figure.

    python benchmarks/compile_stages.py [--backend inductor] [--models gpt,hf_llama,hf_bert]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PP2 = {"pipeline_parallel_degree": 2}
SCHEDULES: tuple[tuple[str, dict[str, Any], str | None], ...] = (
    ("1F1B", {**PP2, "pipeline": "interleaved"}, "Schedule1F1B"),
    ("interleaved v=2", {**PP2, "pipeline": "interleaved", "virtual_pipeline_degree": 2},
     "ScheduleInterleaved1F1B"),
    ("ZB-V", {**PP2, "pipeline": "zbv", "virtual_pipeline_degree": 2}, "ScheduleZBVZeroBubble"),
    ("pp 1 x sdp 2", {"pipeline_parallel_degree": 1, "ddp": True,
                      "sharded_data_parallel_degree": 2}, None))
"""Each row's label, its configuration beside ``compile``, torch's counterpart schedule."""
LENGTHS = (48, 40, 56, 24, 32)  # after --seq (64): 5 new sequence lengths


def _model(name: str, args: argparse.Namespace, untied: bool = False
           ) -> tuple[Any, torch.nn.Module]:
    """``untied``: the GPT's LM head gets its own copy of the embedding (beside torch)."""
    from smp_fx.cli.partition import load_model_file

    ex = load_model_file(str(ROOT / "examples/models" / f"{name}.py"))
    torch.manual_seed(0)
    if name == "gpt":
        gpt = ex.build_model(n_layer=args.layers, n_embd=args.hidden, n_head=4,
                             seq_len=args.seq)
        if untied:
            gpt.lm_head.weight = torch.nn.Parameter(gpt.wte.weight.detach().clone())
        return ex, gpt
    return ex, ex.build_model(num_hidden_layers=args.layers, hidden_size=args.hidden,
                              seq_len=max(args.seq, *LENGTHS))


class _Run:
    """One DistributedModel (eager or compiled) and its step on a batch of a given length."""

    def __init__(self, name: str, config: dict[str, Any], backend: str,
                 args: argparse.Namespace, untied: bool = False) -> None:
        import smp_fx as smp
        from smp_fx.world import state

        state._reset()
        smp.init({**config, "microbatches": args.microbatches, "compile": backend})
        self.ex, model = _model(name, args, untied)
        self.model = smp.DistributedModel(model)
        self.opt = smp.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=1e-3))
        self.vocab = 128
        ex = self.ex

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            loss = ex.loss_fn(model(x), y)
            model.backward(loss)
            return loss

        self.train_step = train_step
        self.args = args

    def batch(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(length)
        x = torch.randint(0, self.vocab, (self.args.batch, length), generator=g)
        return x, torch.randint(0, self.vocab, (self.args.batch, length), generator=g)

    def step(self, length: int) -> float:
        x, y = self.batch(length)
        dist.barrier()
        start = time.perf_counter()
        self.train_step(self.model, x, y)
        self.opt.step()
        self.opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    def stage_lines(self) -> list[str]:
        """Each stage of both ranks in one line (``CompileStats.summary``)."""
        mine = [(s, st.summary()) for s, st in self.model.parallelized.compiled.items()]
        got: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        return [line for _, line in sorted(pair for part in got for pair in part)]

    def counts(self) -> tuple[int, int]:
        """(recompiles, stages running eagerly) over both ranks."""
        stats = self.model.parallelized.compiled.values()
        got = torch.tensor([sum(s.recompiles for s in stats),
                            sum(s.fallback is not None for s in stats)])
        dist.all_reduce(got)
        return int(got[0]), int(got[1])


def _unlike_torch(program: Any) -> str | None:
    """Why torch's ``PipelineStage`` cannot run ``program``'s chunks, or None: it feeds each
    chunk the previous chunk's tensor outputs (the first chunk the batch) and nothing else."""
    from passes.meta import TENSOR

    for st in program.stages:
        peers = [peer for peer, _ in st.recvs]
        if peers not in ([], [st.index - 1]) or (st.index and st.program_inputs):
            return (f"not comparable: chunk {st.index} receives from chunks {peers}; torch "
                    "passes each chunk's outputs to the next one only")
        out = next(n for n in st.module.graph.nodes if n.op == "output")
        if st.index < program.num_stages - 1 and any(
                TENSOR.get(a) is None for a in out.all_input_nodes):
            return (f"not comparable: chunk {st.index} sends values that are not tensors "
                    "(sizes); torch's stages send tensors only")
    return None


def _beside_torch(compiled: _Run, torch_name: str, args: argparse.Namespace
                  ) -> tuple[float, float, float] | str:
    """(smp-fx's, torch's) fastest step with both compiled alike and the median of paired
    ratios, or why torch cannot run them."""
    from benchmarks.schedules_vs_torch import _alternating, _torch_schedule, _torch_step

    program, rank_of = compiled.model.program, tuple(compiled.model.plan.rank_of)
    ex = compiled.ex

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return ex.loss_fn(program.build_outputs(out if isinstance(out, tuple) else (out,)), y)

    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        return torch.compile(module, backend=args.backend, fullgraph=True)  # type: ignore[return-value]

    try:
        sched = _torch_schedule(torch_name, program, rank_of, args.microbatches, loss, wrap)
    except RuntimeError as exc:  # torch's own refusal (zero bubble with compiled stages)
        return f"refused by torch: {exc}"
    reason = _unlike_torch(program)
    if reason is not None:
        return reason
    x, y = compiled.batch(args.seq)
    smp_best, torch_best, paired = _alternating(
        functools.partial(compiled.train_step, compiled.model, x, y),
        _torch_step(sched, rank_of, x, y), 2, args.retries, None)
    compiled.opt.zero_grad()
    return smp_best[0], torch_best[0], paired


def _block(run: _Run, args: argparse.Namespace) -> tuple[float, float]:
    """(the first step, the median of ``args.steps`` after it) of one model."""
    first = run.step(args.seq)
    return first, statistics.median(run.step(args.seq) for _ in range(args.steps))


def _row(name: str, label: str, config: dict[str, Any], torch_name: str | None,
         args: argparse.Namespace) -> dict[str, Any]:
    eager_ms, compiled_ms, ratios, compile_s = [], [], [], []
    for _ in range(args.blocks):  # eager, compiled, eager, ...: each its own smp.init
        _, e = _block(_Run(name, config, "none", args), args)
        compiled = _Run(name, config, args.backend, args)
        first, c = _block(compiled, args)
        eager_ms.append(e * 1e3)
        compiled_ms.append(c * 1e3)
        ratios.append(c / e)
        compile_s.append(first - c)
    before, _ = compiled.counts()
    for n in LENGTHS:
        compiled.step(n)
    after, eager_stages = compiled.counts()
    stages = compiled.stage_lines()
    if torch_name is None:
        beside = "no pipeline: nothing of torch.distributed.pipelining's to compare"
    elif not args.retries:
        beside = "not run"
    else:
        if name == "gpt":  # torch's stages would not sum the tied gradients
            compiled = _Run(name, config, args.backend, args, untied=True)
            compiled.step(args.seq)
        beside = _beside_torch(compiled, torch_name, args)
    return {"model": name, "schedule": label, "eager_ms": statistics.median(eager_ms),
            "compiled_ms": statistics.median(compiled_ms), "ratio": statistics.median(ratios),
            "ratios": ratios, "compile_s": compile_s[0], "recompiles": after - before,
            "eager_stages": eager_stages, "stages": stages, "torch": torch_name or "-",
            "beside": beside}


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration's row, on this rank (one of ``run_ranks``'s two)."""
    dist.init_process_group("gloo")
    return [_row(name, label, config, torch_name, args)
            for name in args.models.split(",")
            for label, config, torch_name in SCHEDULES
            if label in args.schedules.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=3,
                    help="eager and compiled blocks, alternated (each a new model)")
    ap.add_argument("--models", default="gpt,hf_llama,hf_bert")
    ap.add_argument("--schedules", default=",".join(label for label, *_ in SCHEDULES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--retries", type=int, default=15,
                    help="alternated steps beside torch's schedule (0: skip that comparison)")
    args = ap.parse_args()
    from tests.helpers.dist import run_ranks

    rows = run_ranks(_rows, 2, args, timeout=3600)[0]
    print(f"compile={args.backend}, pp 2 (or pp 1 x sdp 2) on 2 gloo processes, "
          f"{args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}, "
          f"{args.microbatches} microbatches; "
          f"{args.blocks} eager and {args.blocks} compiled blocks alternated, each the median "
          f"of {args.steps} steps; ratio: the median of each compiled block over the eager "
          "block before it (each block's ratio after it)")
    print(f"{'model':<9} {'schedule':<16} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} "
          f"{'compile s':>10} {'recompiles/5 lengths':>21} {'eager stages':>13}  blocks")
    for r in rows:
        blocks = " ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"{r['model']:<9} {r['schedule']:<16} {r['eager_ms']:>9.1f} "
              f"{r['compiled_ms']:>12.1f} {r['ratio']:>6.2f} {r['compile_s']:>10.1f} "
              f"{r['recompiles']:>21d} {r['eager_stages']:>13d}  {blocks}")
    print("\nper stage (a split backward's stage that receives gradients: compiled whole, its "
          "GEMMs' weight gradients deferred to W)")
    for r in rows:
        for line in r["stages"]:
            print(f"{r['model']:<9} {r['schedule']:<16} {line}")
    print(f"\nsmp-fx compiled beside torch.distributed.pipelining with the same chunks compiled "
          f"(torch.compile, backend {args.backend}, fullgraph; the GPT's LM head untied); one "
          f"training step without the optimizer, fastest of {args.retries} alternated")
    print(f"{'model':<9} {'schedule':<16} {'torch':<24} {'smp-fx ms':>10} {'torch ms':>9} "
          f"{'ratio':>6} {'paired':>7}")
    for r in rows:
        head = f"{r['model']:<9} {r['schedule']:<16} {r['torch']:<24}"
        if isinstance(r["beside"], str):
            print(f"{head} {r['beside']}")
        else:
            smp_s, torch_s, paired = r["beside"]
            print(f"{head} {smp_s * 1e3:>10.1f} {torch_s * 1e3:>9.1f} {smp_s / torch_s:>6.3f} "
                  f"{paired:>7.3f}")


if __name__ == "__main__":
    main()
