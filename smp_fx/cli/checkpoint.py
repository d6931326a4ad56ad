"""``smp-fx checkpoint``: inspect partial checkpoints and merge them into one full file.

Why: a partial checkpoint (``checkpoint.pt_0``, ``checkpoint.pt_1``, ... plus
``checkpoint.pt.smp_index.json``) needs smp-fx to load; ``merge`` turns it into a single
file in plain torch formats, usable with ``torch.load`` + ``model.load_state_dict(strict=True)``
+ ``optimizer.load_state_dict`` on the unwrapped model, no smp-fx needed.

Example::

    smp-fx checkpoint info /ckpt/checkpoint.pt
    smp-fx checkpoint merge /ckpt/checkpoint.pt -o /ckpt/full.pt
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Sequence

import torch

from cost_model.errors import SMPError
from smp_fx.ckpt.atomic import atomic_write
from smp_fx.ckpt.files import load_partial_set, merge_partial_objects
from smp_fx.ckpt.layout import read_index


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``checkpoint`` argument parser (or fill the one a dispatcher made)."""
    parser = parser or argparse.ArgumentParser(
        prog="smp-fx checkpoint", description="Inspect and merge smp-fx checkpoints.")
    sub = parser.add_subparsers(dest="action", required=True)
    merge = sub.add_parser("merge", help="merge partial files into one full checkpoint")
    merge.add_argument("prefix", help="the path given to smp.save (without _<mp_rank>)")
    merge.add_argument("-o", "--output", required=True, help="the full checkpoint to write")
    merge.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                       help="allow arbitrary pickled objects (trusted files only)")
    info = sub.add_parser("info", help="print what a partial checkpoint's index records")
    info.add_argument("prefix")
    return parser


def merge(prefix: str, output: str, weights_only: bool = True) -> str:
    """Write the full checkpoint of ``prefix`` to ``output``; returns a one-line summary."""
    index, objs = load_partial_set(prefix, map_location="cpu", weights_only=weights_only)
    full = merge_partial_objects(objs, full=True)
    atomic_write(output, lambda fh: torch.save(full, fh, pickle_module=pickle,
                                               pickle_protocol=2))
    keys = sorted(full) if isinstance(full, dict) else [type(full).__name__]
    return (f"merged {len(objs)} file(s) saved at pp={index['pp_degree']} "
            f"tp={index['tp_degree']} into {output} (keys: {', '.join(map(str, keys))})")


def describe(prefix: str) -> str:
    """A readable summary of a partial checkpoint's index."""
    index = read_index(prefix)
    if index is None:
        return f"{prefix}: no partial-checkpoint index (a full checkpoint, or not smp-fx)"
    lines = [f"{prefix}: save {index['save_id']}, pp={index['pp_degree']} "
             f"tp={index['tp_degree']}, {index['num_files']} file(s)"]
    for entry in index["files"]:
        counts = ", ".join(f"{k or '<object>'}: {len(v)} names"
                           for k, v in entry["entries"].items())
        lines.append(f"  {entry['file']}: mp_rank {entry['mp_rank']} pp_rank "
                     f"{entry['pp_rank']} tp_rank {entry['tp_rank']} ({counts or 'no state'})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Execute parsed arguments; SMP errors become a message and exit status 1."""
    try:
        if args.action == "merge":
            print(merge(args.prefix, args.output, args.weights_only))
        else:
            print(describe(args.prefix))
    except SMPError as exc:
        print(f"smp-fx checkpoint: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``smp-fx checkpoint ...`` (argv without the subcommand name)."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
