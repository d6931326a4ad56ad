"""``smp-fx plan MODEL.py --gpus N --global-batch B``: choose and price a cluster plan.

Why: "which configuration, and how fast will it be?" is the first question of anyone with a
model and a cluster. The command builds the model (``build_model()``; ``--meta`` on the meta
device; or a Hugging Face causal LM from ``--hf-config config.json``, ``--seq-len`` tokens
per sample: ``smp_fx.planner.hf_config``), traces it once, and searches tensor, pipeline and
data parallel degrees, microbatching, schedule and virtual stages, recomputation, sequence
parallelism and sharding (``smp_fx.planner``) on a cluster: ``--cluster NAME|FILE.json``, or
``--device a100|h100|v100|h200|b200|cpu|FILE.json`` with ``--gpus-per-node``, the bandwidths and
``--gpu-memory-gib``. It prints the top plans, why the best wins, and optionally writes them
(``--json``), the best's SMP configuration (``--emit-config``: ``smp-fx run`` and
``smp.init`` take it; the search then keeps to what its validation accepts), its simulated
step (``--timeline``), or, for ``--gpus 64,128,...``, the scaling curve (``--plot``).

Example::

    smp-fx plan examples/models/gpt.py --meta --build-arg n_layer=128 \\
        --build-arg n_embd=25600 --build-arg n_head=160 --build-arg vocab_size=51200 \\
        --build-arg seq_len=2048 --inputs-arg seq_len=2048 --inputs-arg vocab_size=51200 \\
        --cluster dgx-a100-80gb --gpus 3072 --global-batch 3072 --precision fp16
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cost_model.cluster import (
    DEVICE_CLUSTER,
    ClusterSpec,
    cluster_for_device,
    cluster_names,
    load_cluster,
)
from cost_model.devices import load_device
from cost_model.errors import SMPConfigError
from cost_model.measurement import Measurement
from cost_model.memory import PRECISIONS
from smp_fx.cli import plan_render
from smp_fx.cli.partition import (
    _call,
    _function,
    _inputs,
    _key_values,
    load_model_file,
    run_or_report,
)
from smp_fx.planner.candidate import parse_fix
from smp_fx.planner.hf_config import prepare_config
from smp_fx.planner.measured import refit
from smp_fx.planner.model import Prepared, Profiler, prepare
from smp_fx.planner.planner import Planned, plan
from smp_fx.planner.profile import model_dtype
from smp_fx.planner.smp_config import refusal, script_notes, smp_config
from smp_fx.planner.step import Setting

GiB = 1024**3


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="smp-fx plan", description="Choose tensor, pipeline and data parallel degrees, "
        "microbatching, schedule and recomputation for a GPU cluster, and predict the step.")
    p.add_argument("model", nargs="?",
                   help="Python file defining build_model() and example_inputs()")
    p.add_argument("--hf-config", metavar="PATH",
                   help="plan a Hugging Face causal LM from its config.json (or the "
                   "directory holding it) instead of a model file; built on meta, no download")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens per sample: required with --hf-config; for a model file, "
                   "passed as seq_len= to its build and inputs functions")
    p.add_argument("--build-fn", default="build_model")
    p.add_argument("--inputs-fn", default="example_inputs",
                   help="f(batch_size) -> inputs; its batch size 1 gives one sample's shape")
    p.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--inputs-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device")
    p.add_argument("--frontend", choices=("fx", "export", "auto"), default="auto",
                   help="auto: fx, or torch.export where fx would hide submodules in "
                   "automatic leaves (Hugging Face models)")
    p.add_argument("--gpus", required=True, help="GPU count, or a list 64,128,... (scaling)")
    p.add_argument("--global-batch", type=int, required=True, help="samples per step")
    p.add_argument("--cluster", help=f"built-in ({', '.join(cluster_names())}) or JSON file")
    p.add_argument("--device", default="a100",
                   help="a100, h100, v100, h200, b200 (their built-in node), cpu, or a spec file")
    p.add_argument("--gpu-memory-gib", type=float)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--intra-node-bandwidth", type=float,
                   help="bytes/s per GPU, one direction (NVLink)")
    p.add_argument("--inter-node-bandwidth", type=float,
                   help="bytes/s per node, one direction, all network cards together")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--fp8", action="store_true",
                   help="price the repeated layers' linears in FP8, as Transformer Engine's "
                   "FP8 recipes run them (the rest in --precision); smp-fx's runtime does "
                   "not train in FP8, so no --emit-config")
    p.add_argument("--fp8-params", action="store_true",
                   help="with --fp8: the layers' weights kept in FP8 alone (Transformer "
                   "Engine's FP8 parameters, NeMo's fp8_params), no copy in --precision")
    p.add_argument("--adam", choices=("foreach", "fused"), default="foreach",
                   help="the Adam the script steps with on a GPU: torch's default "
                   "(foreach: a float32 temporary of the parameters at the step) or a fused "
                   "one (apex, torch's fused=True: none)")
    p.add_argument("--fix", help="tp=8,pp=8,... (keys tp pp dp mbs vp schedule recompute sp "
                                 "zero ep cp): price these, search the rest")
    p.add_argument("--cp-local-outputs", action="store_true",
                   help="under cp, price each rank holding its own tokens of the logits "
                   "(a loss inside the model, or context_parallel_local_outputs, which "
                   "--emit-config then writes), not the whole gathered logits")
    p.add_argument("--top", type=int, default=5, help="plans to show")
    p.add_argument("--max-mbs", type=int, default=64, help="largest microbatch size tried")
    p.add_argument("--json", metavar="FILE", help="write model, cluster, best and candidates")
    p.add_argument("--emit-config", metavar="CFG.JSON",
                   help="write the best runnable plan's SMP configuration")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the best plan's step")
    p.add_argument("--tokens", type=float, default=3e11,
                   help="tokens of a training run, for the GPU-hours of the scaling curve")
    p.add_argument("--plot", metavar="FILE.png", help="draw the scaling curve (--gpus list)")
    p.add_argument("--measured", nargs="+", metavar="FILE",
                   help="refit the cluster's factors on these runs (smp.write_measurement), "
                   "each priced at its own configuration, then plan with the refit")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def make_cluster(args: argparse.Namespace, gpus: int = 1) -> ClusterSpec:
    """The cluster the flags describe (``--cluster`` or ``--device`` plus overrides); a
    device without a built-in node (``cpu``, a calibrated file) is one host of ``gpus``
    processes unless ``--gpus-per-node`` says otherwise."""
    mem = int(args.gpu_memory_gib * GiB) if args.gpu_memory_gib else None
    if args.cluster:
        base = load_cluster(args.cluster)
        from dataclasses import replace

        changes: dict[str, Any] = {}
        for key in ("gpus_per_node", "intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(args, key) is not None:
                changes[key] = getattr(args, key)
        if mem is not None:
            changes["device"] = replace(base.device, memory_bytes=mem)
        return replace(base, **changes) if changes else base
    device = load_device(args.device)
    per_node = args.gpus_per_node
    if per_node is None and device.name not in DEVICE_CLUSTER:
        per_node = gpus
    return cluster_for_device(device, gpus_per_node=per_node,
                              intra_node_bandwidth=args.intra_node_bandwidth,
                              inter_node_bandwidth=args.inter_node_bandwidth,
                              memory_bytes=mem)


def gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as exc:
        raise SMPConfigError.build("--gpus takes N or N1,N2,...", text, "--gpus",
                                   "write --gpus 64 or --gpus 64,128,256") from exc
    if not counts or min(counts) < 1:
        raise SMPConfigError.build("--gpus needs counts >= 1", text, "--gpus", "--gpus 8")
    return counts


def host_factor(cluster: ClusterSpec, gpus: int) -> float:
    """How much slower each process computes when a host's processes outnumber its cores
    (a CPU cluster: ``cpu`` or a calibrated CPU spec): processes per host / cores."""
    if torch.cuda.is_available() or "cpu" not in cluster.device.name:
        return 1.0
    per_host = min(gpus, cluster.gpus_per_node)
    return max(1.0, per_host / max(os.cpu_count() or 1, 1))


def _seq_len_args(fn: Any, seq_len: int | None, where: str,
                  required: bool) -> dict[str, Any]:
    """``{"seq_len": N}`` for a function that takes it; ``--seq-len`` for one that does not
    is an error when ``required`` (the inputs function: its tokens are the plan's)."""
    if seq_len is None:
        return {}
    params = inspect.signature(fn).parameters
    if "seq_len" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {"seq_len": seq_len}
    if required:
        raise SMPConfigError.build(f"--seq-len needs {fn.__name__}() to take seq_len",
                                   str(inspect.signature(fn)), where,
                                   f"add a seq_len parameter to {fn.__name__}() (its "
                                   "inputs set the plan's tokens per sample)")
    return {}


def prepare_model(args: argparse.Namespace, progress: Any) -> Prepared:
    if args.hf_config:
        if args.model:
            raise SMPConfigError.build("plan either a model file or --hf-config",
                                       f"{args.model} and {args.hf_config}", "smp-fx plan",
                                       "drop one of the two")
        if args.seq_len is None:
            raise SMPConfigError.build("--hf-config needs --seq-len (tokens per sample)",
                                       None, "--seq-len", "e.g. --seq-len 8192")
        progress(f"building {args.hf_config} on meta, tracing its first layers")
        prepared = prepare_config(args.hf_config, args.seq_len, args.precision,
                                  args.frontend)
        _report(prepared, progress)
        return prepared
    if not args.model:
        raise SMPConfigError.build("smp-fx plan needs a model file or --hf-config", None,
                                   "smp-fx plan", "pass MODEL.py or --hf-config PATH")
    module = load_model_file(args.model)
    build = _function(module, args.build_fn, args.model)
    make_inputs = _function(module, args.inputs_fn, args.model)
    extra = {**_seq_len_args(make_inputs, args.seq_len, args.model, True),
             **_key_values(args.inputs_arg, "--inputs-arg")}
    build_args = {**_seq_len_args(build, args.seq_len, args.model, False),
                  **_key_values(args.build_arg, "--build-arg")}
    progress(f"building {args.build_fn}() from {args.model}" + (" on meta" if args.meta
                                                                  else ""))
    with torch.device("meta") if args.meta else contextlib.nullcontext():
        model = _call(build, args.model, **build_args)
    if not isinstance(model, nn.Module):
        raise SMPConfigError.build(f"{args.build_fn}() must return a torch.nn.Module",
                                   type(model).__name__, args.model, "return the model")
    model = model.to(model_dtype(args.precision))

    def inputs(batch: int) -> tuple[Any, ...]:
        return _inputs(make_inputs, batch, extra, args.model)

    progress("tracing once, finding repeated layers")
    prepared = prepare(model, inputs, Path(args.model).stem, args.frontend)
    _report(prepared, progress)
    return prepared


def _report(prepared: Prepared, progress: Any) -> None:
    info = prepared.info
    progress(f"{info.nodes} nodes, {info.parameters:,} parameters, "
             + (f"{info.layers} layers ({info.layer_path}): two priced" if info.layers
                else "no repeated layers: every node priced"))


def _json_doc(planned: Planned, prepared: Prepared, cluster: ClusterSpec, gpus: int,
              args: argparse.Namespace) -> dict[str, Any]:
    return {"model": {**prepared.info.to_json(), "global_batch": args.global_batch,
                      "precision": args.precision, "fp8_linears": args.fp8, "gpus": gpus},
            "cluster": cluster.to_json(), "best": planned.best.to_json(),
            "candidates": [r.to_json() for r in planned.records]}


def run(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    t0 = time.perf_counter()

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - t0:6.2f}s] {message}", file=sys.stderr,
                  flush=True)

    if args.fp8 and args.emit_config:
        raise SMPConfigError.build(
            "--emit-config writes what smp-fx's runtime runs, and it does not train in FP8",
            "--fp8 --emit-config", "smp-fx plan",
            "drop --fp8 to emit a configuration (it then plans in --precision), or drop "
            "--emit-config to price FP8")
    fixed = parse_fix(args.fix)
    counts = gpu_counts(args.gpus)
    cluster = make_cluster(args, max(counts))
    prepared = prepare_model(args, progress)

    def setting_of(cl: ClusterSpec, gpus: int, batch: int, precision: str) -> Setting:
        return Setting(cl, gpus, batch, precision, host_factor(cl, gpus),
                       step_temporary=args.adam == "foreach" and "cpu" not in cl.device.name,
                       cp_local_outputs=args.cp_local_outputs, fp8=args.fp8,
                       fp8_params=args.fp8_params)

    before, refitted = cluster, None
    if args.measured:
        progress(f"refitting {cluster.name} on {len(args.measured)} measured run(s)")
        refitted = refit(prepared, cluster, [(Path(f).name, Measurement.load(f))
                                             for f in args.measured], setting_of)
        cluster = refitted.cluster
        print(plan_render.format_refit(refitted), file=out)
    allowed = None
    if args.emit_config:
        def allowed(c: Any) -> str | None:
            return refusal(c, args.global_batch, args.precision)
        progress("--emit-config: keeping to plans smp.init's validation accepts")
    points = []
    planned: Planned | None = None
    best_before = 0.0
    # part pricings shared by every --gpus count
    profiler = Profiler(prepared, cluster, fp8=args.fp8)
    for gpus in counts:
        setting = setting_of(cluster, gpus, args.global_batch, args.precision)
        if setting.compute_factor > 1:
            progress(f"{min(gpus, cluster.gpus_per_node)} processes share "
                     f"{os.cpu_count()} cores: compute priced {setting.compute_factor:.1f}x "
                     "slower")
        planned = plan(prepared, setting, fixed=fixed, allowed=allowed, top_k=args.top,
                       max_mbs=args.max_mbs, profiler=profiler, progress=progress)
        print(f"plan for {prepared.info.name} on {gpus} x {cluster.device.name} "
              f"({cluster.name}, {cluster.gpus_per_node} per node), global batch "
              f"{args.global_batch}, {args.precision}"
              f"{' with FP8 linears' if args.fp8 else ''}", file=out)
        print(plan_render.format_plans(planned), file=out)
        best = planned.best
        if refitted is not None:
            old = plan(prepared, setting_of(before, gpus, args.global_batch, args.precision),
                       fixed=best.candidate.to_json(), top_k=1)
            best_before = old.best.step_time_s
            print(f"the best plan before the refit: {best_before * 1e3:.2f} ms, after: "
                  f"{best.step_time_s * 1e3:.2f} ms", file=out)
        print("", file=out)
        hours = args.tokens / best.tokens_per_s / 3600 * gpus if best.tokens_per_s else 0.0
        points.append(plan_render.ScalePoint(gpus, best, hours))
    assert planned is not None
    if len(points) > 1:
        print(plan_render.format_scaling(points, args.tokens), file=out)
        if args.plot:
            plan_render.plot_scaling(points, args.plot, f"{prepared.info.name} on "
                                     f"{cluster.name}, global batch {args.global_batch}")
            progress(f"wrote {args.plot}")
    gpus = counts[-1]
    if args.json:
        doc = _json_doc(planned, prepared, cluster, gpus, args)
        if refitted is not None:
            doc["refit"] = {**refitted.to_json(), "best_before_s": best_before}
        Path(args.json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n",
                                   encoding="utf-8")
        progress(f"wrote {args.json}")
    if args.emit_config:
        cfg = smp_config(planned.best, args.precision)
        chosen = planned.best.candidate
        if args.cp_local_outputs and chosen.cp > 1 and chosen.pp == 1:
            cfg["context_parallel_local_outputs"] = True  # the memory priced
        Path(args.emit_config).write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n",
                                          encoding="utf-8")
        print(f"wrote {args.emit_config}: smp-fx run -n {gpus} --config {args.emit_config} "
              "SCRIPT.py", file=out)
        notes = script_notes(planned.best, args.precision, prepared.info.layer_path)
        if cfg.get("context_parallel_local_outputs"):
            notes.append("the step function reads its cp rank's tokens of the outputs: pick "
                         "their targets with smp.cp_positions, reduce with smp.cp_mean (or "
                         "compute the loss inside the model)")
        elif args.cp_local_outputs and best.cp > 1:
            notes.append("compute the loss inside the model (the memory priced: "
                         "context_parallel_local_outputs is refused with pipeline parallelism)")
        for note in notes:
            print(f"  in the script: {note}", file=out)
    if args.timeline:
        why = plan_render.draw(planned, args.timeline, f"{prepared.info.name}: "
                               f"{planned.best.candidate.label()}")
        print(why if why else f"wrote {args.timeline}", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_or_report("smp-fx plan", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
