"""``smp-fx checkpoint``: inspect partial checkpoints, merge them into one full file, or
export a model's into what Hugging Face's ``from_pretrained`` loads, so no smp-fx is
needed to use them. See docs/cli.md, 'smp-fx checkpoint merge'.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Sequence

import torch

from cost_model.errors import SMPCheckpointError, SMPError
from smp_fx.ckpt.atomic import atomic_write
from smp_fx.ckpt.checkpoint_api import MODEL_FILE
from smp_fx.ckpt.files import load_partial_set, merge_partial_objects
from smp_fx.ckpt.hf_export import model_from_config, save_pretrained_state
from smp_fx.ckpt.layout import read_index
from smp_fx.nn.huggingface.registry import hf_state


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
    export = sub.add_parser("export", help="write a partial model checkpoint as "
                            "Hugging Face's save_pretrained does (from_pretrained loads it)")
    export.add_argument("prefix", help="the smp.save path of the model's partial state, or "
                        "a smp.save_checkpoint {tag}_partial folder")
    export.add_argument("-o", "--output", required=True, help="the folder to write")
    export.add_argument("--config", help="config.json of the model, or its folder (default: "
                        "found beside the checkpoint or one folder up)")
    return parser


def _model_prefix(prefix: str) -> str:
    """A ``save_checkpoint`` folder stands for its model file."""
    inside = os.path.join(prefix, MODEL_FILE)
    return inside if os.path.isdir(prefix) and read_index(inside) is not None else prefix


def _config_near(prefix: str) -> str:
    here = os.path.dirname(os.path.abspath(prefix))
    for folder in (here, os.path.dirname(here)):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise SMPCheckpointError.build(
        "no config.json beside the checkpoint or one folder up", here,
        where="smp-fx checkpoint export", fix="pass --config path/to/config.json")


def export(prefix: str, output: str, config: str | None = None) -> str:
    """Write the model of the partial checkpoint ``prefix`` into ``output`` as
    ``save_pretrained`` does; returns a one-line summary."""
    prefix = _model_prefix(prefix)
    index, objs = load_partial_set(prefix, map_location="cpu", weights_only=True)
    state = merge_partial_objects(objs, full=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                               for v in state.values()):
        raise SMPCheckpointError.build(
            "export needs a model's state dict", type(state).__name__, where=prefix,
            fix="pass the checkpoint of model.local_state_dict() (a save_checkpoint "
            "folder's model.pt), not an optimizer's")
    model = model_from_config(config or _config_near(prefix))
    state = hf_state(state, model)
    save_pretrained_state(output, state, model)
    return (f"exported {len(state)} tensors saved at pp={index['pp_degree']} "
            f"tp={index['tp_degree']} as {type(model).__name__} into {output}")


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
        elif args.action == "export":
            print(export(args.prefix, args.output, args.config))
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
