"""Every Hugging Face architecture of ``examples/models/hf_zoo.py``, cut at random, under each
feature, across gloo processes, against the plain model: how many match, how many are
refused (with the reason), how many are wrong.

The automatic partitioner's cut follows measured costs, so a model is cut differently on
another machine, under other load, or after a restart; any cut in graph order is one it may
return. Here the solver is replaced by a seeded random cut (``--seed``), and each feature
trains every architecture for 4 Adam steps (a global batch of 4) against the plain model
trained in this process on the same batches, ``state_dict()`` within 1e-5 (1e-4
relative):

* ``zbv``: pp 2 under ZB-V (2 chunks a rank, the split backward), 2 ranks;
* ``tp_zbv``: pp 2 x tp 2 under ZB-V (4 ranks, the tp ranks sharing the batch);
* ``zero1_resume``: pp 2 x dp 2 with ZeRO-1 (4 ranks), a partial checkpoint after 2
  steps; the run itself, and resumed on another random cut at pp 2 x dp 2 and at pp 1 x
  dp 4, each taking the last 2 steps;
* ``sdp``: pp 2 x sharded data parallelism 2 (4 ranks, no gradient clipping);
* ``cp``: pp 2 x context parallelism 2 (4 ranks), SDPA where transformers has it;
* ``cp_tp``: cp 2 x tp 2 (4 ranks, no pipeline), SDPA where transformers has it;
* ``delayed``: pp 2 x tp 2 (4 ranks) built under ``smp.delay_param_initialization``:
  every materialised parameter and buffer equal to the eager build with the same seed;
* ``offload``: pp 2 (2 ranks), every layer (a module named ``...layers.N``, ``h.N``,
  ``block.N``, ...) checkpointed, its inputs offloaded between forward and backward;
* ``interleaved``: pp 2 under interleaved 1F1B (2 chunks a rank), 2 ranks;
* ``tp_sdp``: tp 2 x sharded data parallelism 2 (4 ranks, no pipeline);
* ``tp_zero1``: tp 2 x dp 2 with ZeRO-1 (4 ranks, no pipeline);
* ``pp_tp_rdp``: pp 2 x tp 2 x dp 2 with ZeRO-1 (8 ranks);
* ``tp_checkpointed``: pp 2 x tp 2 (4 ranks), every layer checkpointed;
* ``pp_cp_tp``: pp 2 x cp 2 x tp 2 (8 ranks), SDPA where transformers has it;
* ``varying``, ``varying_sp``, ``varying_cp``: pp 2 x tp 2 (``optimize: speed``, then
  ``memory``: sequence parallelism) and pp 2 x cp 2 (4 ranks), each step of another
  sequence length (16, 11, 7, 20 tokens; 16, 10, 6, 20 with sequence parallelism; 16, 12,
  8, 20 under cp), as a dynamically padded batch is;
* ``compile``, ``compile_zbv``: pp 2 with each stage under ``torch.compile`` (inductor),
  under 1F1B and under ZB-V (its chunks compiled in regions between their GEMMs); a stage
  or region that ran eagerly is listed as fallen back, with the reason;
  ``varying_compile``: compiled under 1F1B, each step of another length (16, 11, 7, 20);
  ``compile_sdp``: pp 2 x sharded data parallelism 2 (4 ranks) compiled under 1F1B, each
  stage one FSDP2 unit; ``compile_tp_sdp``: tp 2 x sdp 2 (4 ranks, no pipeline) compiled;

A case that ran but fell back (a checkpointed layer the cut split runs without
checkpointing, with a warning; a stage that could not compile runs eagerly) is counted ok
and listed with what fell back and why. A refusal is an ``SMPError`` raised before
training (``smp.SMPPassError`` or ``smp.SMPConfigError``: the rewrite or the configuration
says what it cannot do); any other exception, or a state that differs, is counted wrong.
Exit status 1 when any case is wrong. ``--archs``, ``--features`` pick a subset. Takes
about 50 minutes for all of them on 2 CPU cores.

    python benchmarks/random_cuts.py
    python benchmarks/random_cuts.py --features cp --archs mixtral,roberta --seed 3
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCH, STEPS, LR = 4, 4, 1e-3
TOL = {"atol": 1e-5, "rtol": 1e-4}
SDP = {"sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0,
       "sdp_param_persistence_threshold": 64}
FELL_BACK: list[str] = []
"""What the current case ran otherwise than asked (with the reason), reported beside it."""
FEATURES: dict[str, int] = {"zbv": 2, "tp_zbv": 4, "zero1_resume": 4, "sdp": 4, "cp": 4,
                            "cp_tp": 4, "delayed": 4, "offload": 2, "interleaved": 2,
                            "tp_sdp": 4, "tp_zero1": 4, "pp_tp_rdp": 8,
                            "tp_checkpointed": 4, "pp_cp_tp": 8, "compile": 2,
                            "compile_zbv": 2, "varying": 4, "varying_sp": 4,
                            "varying_cp": 4, "varying_compile": 2, "compile_sdp": 4,
                            "compile_tp_sdp": 4}
"""Each feature and the ranks it runs on."""


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, eps=1e-6)


def attention_of(arch: str) -> str:
    """``sdpa`` where transformers builds ``arch`` with it, else ``eager``."""
    from examples.models import hf_zoo

    try:
        hf_zoo.build(arch, marked=False, attention="sdpa")
    except (ValueError, ImportError):
        return "eager"
    return "sdpa"


def _run(arch: str, config: dict[str, Any], **kwargs: Any) -> Any:
    from tests.helpers.zoo import DistributedRun

    return DistributedRun(arch, config, _adam, **kwargs)


def _wrong(run: Any, want: dict[str, torch.Tensor], what: str) -> list[str]:
    from tests.helpers.compare import mismatched

    return [f"{what}: {n}" for n in mismatched(run.state(), want, **TOL)[:3]]


TRAINED: dict[str, dict[str, Any]] = {
    "zbv": {"pipeline_parallel_degree": 2, "pipeline": "zbv", "virtual_pipeline_degree": 2},
    "tp_zbv": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
               "prescaled_batch": True, "pipeline": "zbv", "virtual_pipeline_degree": 2},
    "sdp": {"pipeline_parallel_degree": 2, **SDP},
    "cp": {"pipeline_parallel_degree": 2, "context_parallel_degree": 2},
    "cp_tp": {"pipeline_parallel_degree": 1, "context_parallel_degree": 2,
              "tensor_parallel_degree": 2, "prescaled_batch": True},
    "offload": {"pipeline_parallel_degree": 2, "offload_activations": True},
    "interleaved": {"pipeline_parallel_degree": 2, "pipeline": "interleaved",
                    "virtual_pipeline_degree": 2},
    "tp_sdp": {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2,
               "prescaled_batch": True, **SDP},
    "tp_zero1": {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2,
                 "prescaled_batch": True, "shard_optimizer_state": True},
    "pp_tp_rdp": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                  "prescaled_batch": True, "shard_optimizer_state": True},
    "tp_checkpointed": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                        "prescaled_batch": True},
    "pp_cp_tp": {"pipeline_parallel_degree": 2, "context_parallel_degree": 2,
                 "tensor_parallel_degree": 2, "prescaled_batch": True},
    "varying": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                "prescaled_batch": True, "optimize": "speed"},
    "varying_sp": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                   "prescaled_batch": True},
    "varying_cp": {"pipeline_parallel_degree": 2, "context_parallel_degree": 2},
    "compile": {"pipeline_parallel_degree": 2, "compile": "inductor"},
    "varying_compile": {"pipeline_parallel_degree": 2, "compile": "inductor"},
    "compile_zbv": {"pipeline_parallel_degree": 2, "compile": "inductor", "pipeline": "zbv",
                    "virtual_pipeline_degree": 2},
    "compile_sdp": {"pipeline_parallel_degree": 2, "compile": "inductor", **SDP},
    "compile_tp_sdp": {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2,
                       "prescaled_batch": True, "compile": "inductor", **SDP},
}
"""The features that train under one configuration: each its configuration."""
CHECKPOINTED = {"offload", "tp_checkpointed"}
"""The features that checkpoint every layer (``tests.helpers.zoo.LAYER``)."""
LENGTHS: dict[str, tuple[int, ...]] = {"varying": (16, 11, 7, 20), "varying_sp": (16, 10, 6, 20),
                                       "varying_cp": (16, 12, 8, 20),
                                       "varying_compile": (16, 11, 7, 20)}
"""The features whose steps change the sequence length (a dynamically padded batch): each
step's length (under sequence parallelism a multiple of tp, under cp of 2 x cp)."""


def _lengths(feature: str) -> tuple[int, ...]:
    """Each step's sequence length under ``feature`` (cycled)."""
    from examples.models import hf_zoo

    return LENGTHS.get(feature, (hf_zoo.SEQ,))


def _attention(feature: str, arch: str) -> str:
    """The attention a feature builds ``arch`` with: SDPA for context parallelism."""
    cp = TRAINED.get(feature, {}).get("context_parallel_degree", 1) > 1
    return attention_of(arch) if cp else "eager"


def _zero1_resume(arch: str, want: Any, data: list[Any], path: str) -> list[str]:
    import smp_fx as smp

    zero = {"pipeline_parallel_degree": 2, "shard_optimizer_state": True}
    run = _run(arch, zero)
    run.step(data[0])
    run.step(data[1])
    smp.save_checkpoint(path, "half", model=run.model, optimizer=run.opt)
    run.step(data[2])
    run.step(data[3])
    bad = _wrong(run, want, "uninterrupted")
    for name, config in (("resumed on another cut", zero),
                         ("resumed at pp 1 x dp 4", {"pipeline_parallel_degree": 1})):
        resumed = _run(arch, config, seed=1)  # other weights: all must come from the files
        smp.resume_from_checkpoint(path, "half")
        resumed.step(data[2])
        resumed.step(data[3])
        bad += _wrong(resumed, want, name)
    return bad


class _Skipped(logging.Handler):
    """The checkpointed modules the partitioner's cut split, which run without
    checkpointing (``passes.checkpoint_regions`` warns of each)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        self.names.append(str(args[0]) if args else record.getMessage())


def _not_compiled(model: Any) -> list[str]:
    """The stages (or regions of them) of this rank that ran eagerly under ``compile``; a
    rank holding parameters that compiled nothing at all is listed too (a stage whose
    graph reached the compiler without a tensor operation, or a GEMM alone under a split
    backward, compiles nothing by design)."""
    compiled = list(model.parallelized.compiled.values())
    out = [f"{s.where} eager ({s.fallback})" for stats in compiled
           for s in [stats, *stats.regions] if s.fallback is not None]
    if not sum(stats.compiles for stats in compiled) and any(s.params for s in compiled):
        out.append("nothing compiled on this rank: "
                   + "; ".join(stats.summary() for stats in compiled))
    return out


def _trained(feature: str) -> Callable[[str, Any, list[Any], str], list[str]]:
    """The case of a ``TRAINED`` feature: every step, then the state against ``want``; what
    fell back (a checkpointed layer the cut split, a stage that did not compile) listed."""

    def case(arch: str, want: Any, data: list[Any], path: str) -> list[str]:
        skipped = _Skipped()
        logger = logging.getLogger("smp_fx.checkpointing")
        logger.addHandler(skipped)
        try:
            run = _run(arch, TRAINED[feature], attention=_attention(feature, arch),
                       checkpointed=feature in CHECKPOINTED)
            for batch in data:
                run.step(batch)
        finally:
            logger.removeHandler(skipped)
        FELL_BACK.extend(f"{name} not checkpointed (cut by the partition)"
                         for name in dict.fromkeys(skipped.names))
        if TRAINED[feature].get("compile", "none") != "none":
            FELL_BACK.extend(_not_compiled(run.model))
        return _wrong(run, want, feature)

    return case


def _delayed(arch: str, want: Any, data: list[Any], path: str) -> list[str]:
    import smp_fx as smp
    from smp_fx.world import state
    from tests.smp_fx.marking.test_delayed_init_dist import _wrong as unlike_eager

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 1,
              "ddp": True})
    return unlike_eager(arch)


CASES: dict[str, Callable[[str, Any, list[Any], str], list[str]]] = {
    **{feature: _trained(feature) for feature in TRAINED}, "zero1_resume": _zero1_resume,
    "delayed": _delayed}


def _ranks(feature: str, archs: list[str], refs_file: str, seed: int, folder: str
           ) -> dict[str, str]:
    """One rank's verdict per architecture: ``ok``, ``refused: ...`` or ``WRONG: ...``."""
    import torch.distributed as dist

    import passes.auto_partition as auto
    import smp_fx as smp
    from tests.helpers import zoo
    from tests.smp_fx.test_schedules_cuts import _random_cuts

    faulthandler.enable()  # a rank that crashes says where
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    refs = torch.load(refs_file, weights_only=True)
    auto.solve_problem = _random_cuts(seed)
    out: dict[str, str] = {}
    for i, arch in enumerate(archs):
        if dist.get_rank() == 0:
            print(f"{feature}: {arch} ({i + 1} of {len(archs)})", file=sys.stderr, flush=True)
        data = zoo.batches(arch, BATCH, STEPS, _lengths(feature))
        FELL_BACK.clear()
        try:
            bad = CASES[feature](arch, refs.get(arch), data, os.path.join(folder, arch))
            out[arch] = "WRONG: " + "; ".join(bad) if bad else (
                f"ok, fell back: {'; '.join(FELL_BACK)}" if FELL_BACK else "ok")
        except (smp.SMPPassError, smp.SMPConfigError) as exc:
            out[arch] = "refused: " + str(exc).split(" (got")[0][:160]
        except Exception as exc:  # reported, counted wrong
            out[arch] = f"WRONG: {type(exc).__name__}: {str(exc)[:200]}"
    return out


def _verdict(ranks: list[str]) -> str:
    """One case's verdict from every rank's: wrong if any rank saw it wrong, with the cause
    (a rank's own error before another rank's report of losing or waiting for it); ok
    with what fell back on any rank."""
    wrong = [v for v in ranks if v.startswith("WRONG")]
    causes = [v for v in wrong if "SMPPeerError" not in v and "SMPTimeoutError" not in v]
    refused = [v for v in ranks if not v.startswith("ok")]
    if causes or wrong or refused:
        return (causes or wrong or refused)[0]
    fell = [f for v in ranks if v.startswith("ok, fell back: ")
            for f in v.removeprefix("ok, fell back: ").split("; ")]
    return f"ok, fell back: {'; '.join(dict.fromkeys(fell))}" if fell else "ok"


def _references(feature: str, archs: list[str], path: str) -> None:
    """The plain model's ``state_dict()`` after the 4 Adam steps, per architecture."""
    from tests.helpers import zoo

    refs = {}
    for arch in archs:
        if feature == "delayed":
            continue  # compared with the eager build inside the ranks
        refs[arch] = zoo.reference(arch, BATCH, STEPS, _adam,
                                   attention=_attention(feature, arch),
                                   lengths=_lengths(feature))[1]
    torch.save(refs, path)


def main(argv: list[str] | None = None) -> int:
    from examples.models import hf_zoo
    from tests.helpers.dist import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(hf_zoo.ARCHITECTURES))
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    archs, features = args.archs.split(","), args.features.split(",")
    unknown = sorted(set(features) - set(FEATURES)) + sorted(
        set(archs) - set(hf_zoo.ARCHITECTURES))
    if unknown:
        parser.error(f"unknown feature or architecture {unknown}; features: {list(FEATURES)}")
    torch.set_num_threads(1)
    verdicts: dict[str, dict[str, str]] = {}
    for feature in features:
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            refs = os.path.join(tmp, "refs.pt")
            _references(feature, archs, refs)
            results = run_ranks(_ranks, FEATURES[feature], feature, archs, refs, args.seed, tmp,
                                timeout=3600, env={"SMP_FX_TIMEOUT_S": "120",
                                                   "SMP_FX_DEVICE_SPEC": "a100"})
        verdicts[feature] = {a: _verdict([r[a] for r in results]) for a in archs}
        counts = [sum(v.startswith(k) for v in verdicts[feature].values())
                  for k in ("ok", "refused", "WRONG", "ok, fell back")]
        print(f"{feature}: {counts[0]} ok ({counts[3]} of them falling back), {counts[1]} "
              f"refused, {counts[2]} wrong ({time.monotonic() - start:.0f} s)", flush=True)
    width = max(map(len, archs))
    print("\n" + "arch".ljust(width) + "  " + "  ".join(f.ljust(12) for f in features))
    for arch in archs:
        print(arch.ljust(width) + "  " + "  ".join(
            verdicts[f][arch].split(":")[0].replace(", fell back", "*").ljust(12)
            for f in features))
    print("(* ran, but fell back: below)")
    notes = [(f, a, v) for f in features for a, v in verdicts[f].items() if v != "ok"]
    for feature, arch, verdict in notes:
        print(f"- {feature} {arch}: {verdict}")
    return 1 if any(v.startswith("WRONG") for _, _, v in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
