"""``smp-fx partition model.py``: make a partition plan offline and explain it.

It plans on the first microbatch of ``smp.step``'s own splitter, from the request
``DistributedModel`` builds, so it is the plan the first step makes. Bad input exits 2.
See docs/cli.md, 'smp-fx partition model.py'.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import inspect
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from cost_model.devices import DEFAULT_DEVICE, load_device
from cost_model.errors import SMPConfigError, SMPError, first_line
from cost_model.schedule import SCHEDULE_NAMES
from passes.pipeline import Compiled, baseline_plans
from smp_fx.cli import render
from smp_fx.config import SMPConfig, load_config
from smp_fx.marking.activation_checkpointing import rules_from_patterns
from smp_fx.runtime.inputs.microbatch import split_inputs
from smp_fx.runtime.planning.plan_request import plan_request

EXIT_BAD_INPUT = 2

# command-line flag -> SMP configuration parameter
_FLAG_TO_PARAM = {
    "partitions": "pipeline_parallel_degree",
    "memory_weight": "memory_weight",
    "microbatches": "microbatches",
    "pipeline": "pipeline",
    "virtual_pipeline_degree": "virtual_pipeline_degree",
    "active_microbatches": "active_microbatches",
    "auto_partition": "auto_partition",
    "default_partition": "default_partition",
    "tensor_parallel_degree": "tensor_parallel_degree",
    "prescaled_batch": "prescaled_batch",
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``partition`` argument parser (or fill the one a dispatcher made)."""
    p = parser or argparse.ArgumentParser(
        prog="smp-fx partition",
        description="Partition a model into pipeline stages offline and explain the plan.")
    p.add_argument("model", help="Python file defining build_model() and example_inputs()")
    p.add_argument("--build-fn", default="build_model", help="model factory name")
    p.add_argument("--inputs-fn", default="example_inputs",
                   help="inputs factory name: f(batch_size) -> tuple of positional args")
    p.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--inputs-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra keyword argument for the inputs factory (repeatable)")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device (no weight memory)")
    p.add_argument("--config", metavar="CFG.JSON", help="SMP parameters as a JSON object")
    p.add_argument("--partitions", type=int, help="pipeline_parallel_degree")
    p.add_argument("--memory-weight", type=float)
    p.add_argument("--microbatches", type=int)
    p.add_argument("--pipeline", choices=SCHEDULE_NAMES,
                   help="schedule: simple (GPipe; looped BFS at v > 1), interleaved (1F1B; "
                        "Megatron's interleaved 1F1B at v > 1), zero_bubble (ZB-H1; "
                        "interleaved zero bubble at v > 1), zbv (ZB-V, v = 2)")
    p.add_argument("--virtual-pipeline-degree", type=int, metavar="V",
                   help="virtual_pipeline_degree: chunks per pipeline rank (smp-fx extension)")
    p.add_argument("--active-microbatches", type=int)
    p.add_argument("--auto-partition", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--default-partition", type=int)
    p.add_argument("--tensor-parallel-degree", type=int,
                   help="tensor_parallel_degree: shard the modules the model file marks "
                        "(smp.tensor_parallelism, smp.set_tensor_parallelism, smp.nn); the "
                        "table shows one rank's time and memory")
    p.add_argument("--prescaled-batch", action=argparse.BooleanOptionalAction, default=None,
                   help="prescaled_batch (with --tensor-parallel-degree)")
    p.add_argument("--activation-checkpointing", action="append", default=[],
                   metavar="GLOB[:STRATEGY]",
                   help="checkpoint the modules whose path matches (strategy each, contiguous "
                        "or group_N for an nn.Sequential; attention_core: only the attention "
                        "cores inside, any module); repeatable")
    p.add_argument("--offload", action="store_true",
                   help="offload_activations: checkpointed regions' inputs leave the device")
    p.add_argument("--memory", action="store_true",
                   help="print the memory breakdown (always with checkpointing or --offload)")
    p.add_argument("--optimizer-state-factor", type=float, default=2.0,
                   help="optimizer state bytes per parameter byte (Adam: 2)")
    p.add_argument("--data-parallel-degree", type=int, default=1, metavar="DP",
                   help="rdp ranks that shard_optimizer_state divides the optimizer over")
    p.add_argument("--batch-size", type=int,
                   help="global batch for example_inputs (default: one sample per microbatch)")
    p.add_argument("--non-split-input", action="append", default=[], metavar="NAME",
                   help="forward parameter passed whole to every microbatch (repeatable)")
    p.add_argument("--input-split-axis", action="append", default=[], metavar="NAME=AXIS",
                   help="forward parameter split along AXIS instead of 0 (repeatable)")
    p.add_argument("--frontend", choices=("auto", "fx", "export"), default="auto")
    p.add_argument("--device", default=DEFAULT_DEVICE,
                   help="device spec: h100, a100, v100, h200, b200, cpu (measured here, "
                        "quick), or a spec file written by `smp-fx calibrate -o FILE.json`")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--dot", metavar="FILE", help="write the graph coloured by stage (dot)")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the simulated pipeline")
    p.add_argument("--chrome-trace", metavar="FILE.json",
                   help="write the simulated step for chrome://tracing / Perfetto")
    p.add_argument("--compare", action="store_true",
                   help="score the baseline partitioners on the same costs")
    p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    return p


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _key_values(items: Sequence[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SMPConfigError.build(f"{flag} takes KEY=VALUE", item, flag,
                                       f"write e.g. {flag} n_layer=4")
        out[key] = _literal(value)
    return out


def load_model_file(path: str) -> ModuleType:
    """Import a model file by path (it need not be on ``sys.path`` or in a package)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"smp_fx_user_model_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def _function(module: ModuleType, name: str, path: str) -> Callable[..., Any]:
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SMPConfigError.build(f"the model file must define a function {name}()", fn,
                                   path, f"define {name} or pass its name with --build-fn/"
                                   "--inputs-fn")
    return fn


def smp_parameters(args: argparse.Namespace) -> dict[str, Any]:
    """SMP parameters from ``--config`` overridden by the flags that were given."""
    params: dict[str, Any] = {}
    if args.config:
        with open(args.config, encoding="utf-8") as fh:
            try:
                params = json.load(fh)
            except json.JSONDecodeError as exc:
                raise SMPConfigError.build("--config must hold a JSON object", args.config,
                                           f"line {exc.lineno}", "fix the JSON") from exc
        if not isinstance(params, dict):
            raise SMPConfigError.build("--config must hold a JSON object",
                                       type(params).__name__, args.config, "use {...}")
    if getattr(args, "offload", False):
        params["offload_activations"] = True
    for flag, name in _FLAG_TO_PARAM.items():
        value = getattr(args, flag)
        if value is not None:
            params.pop("partitions" if name == "pipeline_parallel_degree" else name, None)
            params[name] = value
    return params


def smp_config(params: dict[str, Any]) -> SMPConfig:
    """Validate SMP parameters as ``smp.init`` does (the configuration parsed once)."""
    return load_config(_planning(params), env={})


def _planning(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as the plan sees them: tensor parallelism implies ddp (``smp.init``
    requires it; gradient reduction does not change the plan)."""
    tp = params.get("tensor_parallel_degree")
    if isinstance(tp, int) and tp > 1:
        return {"ddp": True, **params}
    return params


def _call(fn: Callable[..., Any], where: str, *args: Any, **kwargs: Any) -> Any:
    """Call a user factory; a signature mismatch is bad input, not a crash."""
    try:
        return fn(*args, **kwargs)
    except TypeError as exc:
        raise SMPConfigError.build(f"{fn.__name__}() could not be called with these arguments",
                                   str(exc), where, "check --build-arg / --inputs-arg and the "
                                   "function's signature") from exc


def _inputs(fn: Callable[..., Any], batch_size: int, extra: dict[str, Any],
            where: str) -> tuple[Any, ...]:
    value = _call(fn, where, batch_size, **extra)
    if isinstance(value, torch.Tensor):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise SMPConfigError.build("example_inputs must return a tuple of positional args",
                                   type(value).__name__, where, "return (tensor, ...)")
    return tuple(value)


def _split_axes(model: nn.Module, non_split: Sequence[str],
                axis_items: Sequence[str]) -> dict[str, int]:
    """``--input-split-axis`` as a dict, every named parameter checked against ``forward``."""
    axes = _key_values(axis_items, "--input-split-axis")
    names = list(inspect.signature(model.forward).parameters)
    for name in [*non_split, *axes]:
        if name not in names:
            raise SMPConfigError.build("the model's forward has no parameter of this name",
                                       name, "--non-split-input / --input-split-axis",
                                       f"use one of {names}")
    for name, axis in axes.items():
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise SMPConfigError.build("a split axis must be an integer", axis,
                                       f"--input-split-axis {name}", f"write {name}=1")
    return axes


def compare_rows(compiled: Compiled) -> tuple[list[render.CompareRow], list[str]]:
    """The plan and every baseline partitioner, scored by the plan's own objective, and a
    note for each baseline that cannot partition this graph."""
    plans = [(f"smp-fx ({compiled.plan.strategy})", compiled.plan)]
    notes = []
    for b in baseline_plans(compiled):
        if b.plan is None:
            notes.append(f"{b.name}: not applicable ({b.error.splitlines()[0]})")
        else:
            plans.append((b.name, b.plan))
    rows = [render.CompareRow(name, tuple(s.cost for s in p.stages), p.objective,
                              p.lower_bound, p.step_time_s) for name, p in plans]
    return rows, notes


class _Progress:
    """Prints each compile step and its duration on stderr (silent with --quiet)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.2f}s] {message}", file=sys.stderr,
                  flush=True)


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Do the work of the command; errors propagate (``main`` turns them into exit 2)."""
    out = out or sys.stdout
    progress = _Progress(args.quiet)
    spec = load_device(args.device)
    cfg = smp_config(smp_parameters(args))
    module = load_model_file(args.model)
    build = _function(module, args.build_fn, args.model)
    make_inputs = _function(module, args.inputs_fn, args.model)
    batch = args.batch_size or cfg.microbatches
    if batch < 1 or batch % cfg.microbatches:
        raise SMPConfigError.build("the batch size must be divisible by microbatches", batch,
                                   f"microbatches={cfg.microbatches}",
                                   "pick --batch-size as a multiple of --microbatches")
    progress(f"building {args.build_fn}() from {args.model}" + (" on meta" if args.meta
                                                                  else ""))
    ctx = torch.device("meta") if args.meta else contextlib.nullcontext()
    with ctx:
        model = _call(build, args.model, **_key_values(args.build_arg, "--build-arg"))
    if not isinstance(model, nn.Module):
        raise SMPConfigError.build(f"{args.build_fn}() must return a torch.nn.Module",
                                   type(model).__name__, args.model, "return the model")
    inputs = _inputs(make_inputs, batch, _key_values(args.inputs_arg, "--inputs-arg"),
                     args.model)
    axes = _split_axes(model, args.non_split_input, args.input_split_axis)
    mb_args, mb_kwargs = split_inputs(inputs, {}, cfg.microbatches, args.non_split_input,
                                      axes, model.forward)[0]
    # tensor parallelism: rank 0's rewrite (every tp rank's costs are the same)
    request = plan_request(cfg, model, spec, tp_rank=0,
                           checkpointing=rules_from_patterns(model,
                                                             args.activation_checkpointing),
                           optimizer_state_factor=args.optimizer_state_factor,
                           data_parallel_degree=args.data_parallel_degree)
    compiled = request.compile(model, mb_args, mb_kwargs, frontend=args.frontend,
                               progress=progress)
    plan = compiled.plan
    print(render.format_table(plan), file=out)
    if compiled.tp_plan is not None:
        print("", file=out)
        print(render.format_tensor_parallel(compiled.tp_plan, dict(model.named_parameters())),
              file=out)
    if args.memory or request.config.checkpointing or args.offload:
        print("", file=out)
        print(render.format_memory(plan), file=out)
    if args.compare:
        progress("scoring baselines")
        print("", file=out)
        rows, notes = compare_rows(compiled)
        print(render.format_compare(rows), file=out)
        for note in notes:
            print(note, file=out)
    if args.json:
        Path(args.json).write_text(plan.dumps(), encoding="utf-8")
        progress(f"wrote {args.json}")
    if args.dot:
        Path(args.dot).write_text(render.to_dot(compiled.gm, plan), encoding="utf-8")
        progress(f"wrote {args.dot}")
    if args.timeline:
        render.draw_timeline(plan.simulate(), args.timeline,
                             f"{Path(args.model).stem}: {render.shape_words(plan)}, "
                             f"{plan.config.pipeline}, {plan.config.microbatches} microbatches, "
                             f"pipeline {render.human_time(plan.pipeline_time_s)}, bubble "
                             f"{plan.bubble_fraction:.1%}")
        progress(f"wrote {args.timeline}")
    if args.chrome_trace:
        events = plan.simulate().chrome_trace()
        Path(args.chrome_trace).write_text(json.dumps({"traceEvents": events}),
                                           encoding="utf-8")
        progress(f"wrote {args.chrome_trace}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``smp-fx partition ...``; returns the exit status."""
    return run_or_report("smp-fx partition", run, build_parser().parse_args(argv))


def run_or_report(prog: str, run: Callable[[argparse.Namespace], int],
                  args: argparse.Namespace) -> int:
    """``run(args)``; bad input (an SMP error, a file missing, a model file that does not
    import) becomes its first line on stderr and the exit status ``EXIT_BAD_INPUT``."""
    try:
        return run(args)
    except (SMPError, OSError, ImportError, SyntaxError) as exc:
        print(f"{prog}: error: {first_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
