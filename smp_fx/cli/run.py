"""``smp-fx run -n N [--config cfg.json] script.py [args...]``: torchrun with SMP's names.

The children get ``SM_HP_MP_PARAMETERS`` and the shim directory, so SageMaker scripts run
unchanged; on failure it names the rank that failed first. See docs/cli.md and
docs/launch.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from cost_model.errors import SMPConfigError
from passes import export_cache
from smp_fx._compat import SHIM_DIR
from smp_fx.config import ENV_VAR, load_config, resolve_topology
from smp_fx.world import elastic, reports

# smp-fx run option -> torchrun option, passed through when given.
PASS_THROUGH: dict[str, str] = {
    "--nnodes": "--nnodes", "--node-rank": "--node-rank", "--rdzv-backend": "--rdzv-backend",
    "--rdzv-endpoint": "--rdzv-endpoint", "--rdzv-id": "--rdzv-id",
    "--master-addr": "--master-addr", "--master-port": "--master-port",
    "--max-restarts": "--max-restarts", "--rdzv-conf": "--rdzv-conf",
}

HELP = {"--max-restarts": "restart every worker up to N times after a failure (torchrun's "
        "elastic restarts); a script that resumes from its last checkpoint goes on from there",
        "--nnodes": "nodes: N, or MIN:MAX for a job that goes on with fewer nodes and grows "
        "back (docs/faults.md, 'Elastic resume')"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smp-fx run", description="Launch a training script on N local processes "
        "(torchrun) with the SMP configuration and the smdistributed import names.")
    p.add_argument("-n", "--nproc-per-node", type=int, required=True,
                   help="processes on this node (one per GPU on a GPU node)")
    p.add_argument("--config", help="JSON file of SMP parameters (sets SM_HP_MP_PARAMETERS)")
    p.add_argument("--backend", choices=("gloo", "nccl"),
                   help="process group backend for smp.init (default: nccl if CUDA, else gloo)")
    for flag in PASS_THROUGH:
        p.add_argument(flag, help=HELP.get(flag, f"passed to torchrun as {PASS_THROUGH[flag]}"))
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command and the added environment, run nothing")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def build(ns: argparse.Namespace,
          environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """(torchrun command, environment additions for the children) from parsed options."""
    if ns.nproc_per_node < 1:
        raise SMPConfigError.build("-n must be >= 1", ns.nproc_per_node, "smp-fx run",
                                   "pass the number of processes, e.g. -n 2")
    if ns.max_restarts is not None and not str(ns.max_restarts).isdigit():
        raise SMPConfigError.build("--max-restarts must be a whole number >= 0",
                                   ns.max_restarts, "smp-fx run", "pass e.g. --max-restarts 2")
    added: dict[str, str] = {}
    if ns.config:
        params = dict(json.loads(environ[ENV_VAR])) if environ.get(ENV_VAR) else {}
        with open(ns.config, encoding="utf-8") as f:
            params.update(json.load(f))
        cfg = load_config(params, env={})  # fail here, once, rather than in N children
        if ns.nnodes is None or str(ns.nnodes).isdigit():
            resolve_topology(cfg, ns.nproc_per_node * int(ns.nnodes or 1))
        elastic.check_range(cfg, ns.nnodes, ns.nproc_per_node)
        added[ENV_VAR] = json.dumps(params, sort_keys=True)
    old = environ.get("PYTHONPATH")
    added["PYTHONPATH"] = str(SHIM_DIR) + (os.pathsep + old if old else "")
    if ns.backend:
        added["SMP_FX_BACKEND"] = ns.backend
    cmd = [sys.executable, "-m", "smp_fx.cli.torchrun",
           "--nproc-per-node", str(ns.nproc_per_node)]
    multi_node = any(getattr(ns, f[2:].replace("-", "_")) is not None
                     for f in ("--nnodes", "--rdzv-endpoint", "--master-addr"))
    if not multi_node:
        cmd.append("--standalone")
    else:
        added.update(elastic.launch_env(ns.nnodes, ns.nproc_per_node,
                                        int(ns.max_restarts or 0) > 0))
    for flag, target in PASS_THROUGH.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None:
            cmd += [target, str(value)]
    cmd += [ns.script, *ns.script_args]
    return cmd, added


def run_export_cache(root: str) -> dict[str, str]:
    """The export cache of one run, unless the caller chose one (or none, with an empty
    ``SMP_FX_EXPORT_CACHE``): a directory in the run's own, removed with it. A restart
    within the run (after a fault, or an elastic change of world) loads the graphs its
    first attempt exported instead of exporting them again (``passes.export_cache``)."""
    if export_cache.ENV in os.environ:
        return {}
    return {export_cache.ENV: os.path.join(root, "export_cache")}


def main(argv: Sequence[str]) -> int:
    ns = parser().parse_args(list(argv))
    try:
        cmd, added = build(ns, os.environ)
    except (SMPConfigError, OSError, json.JSONDecodeError) as exc:
        print(f"smp-fx run: {exc}", file=sys.stderr)
        return 2
    if ns.dry_run:
        for key, value in added.items():
            print(f"{key}={value}")
        print(" ".join(cmd))
        return 0
    own = not os.environ.get(reports.ENV)
    root = tempfile.mkdtemp(prefix="smp-fx-run-") if own else os.environ[reports.ENV]
    try:
        env = {**os.environ, **added, reports.ENV: root, **run_export_cache(root)}
        code = subprocess.run(cmd, env=env, check=False).returncode
        for line in reports.summary(root):
            print(f"smp-fx run: {line}", file=sys.stderr)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return code
