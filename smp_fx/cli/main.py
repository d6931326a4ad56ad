"""``smp-fx <command> ...``: a table of subcommand name -> module with ``main(argv) -> int``.

Adding a subcommand is one line in ``COMMANDS``; the module is imported only when used, so
``smp-fx run`` does not pay for the compiler's imports.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("smp_fx.cli.run", "launch N local processes through torchrun with smp-fx's "
            "SageMaker import names"),
    "partition": ("smp_fx.cli.partition", "make a partition plan offline and explain it"),
    "checkpoint": ("smp_fx.cli.checkpoint", "inspect, merge or export (Hugging Face) partial "
                   "checkpoints"),
    "calibrate": ("smp_fx.cli.calibrate", "measure this machine into a device spec file for "
                  "partition --device"),
}


def _usage() -> str:
    lines = ["usage: smp-fx <command> [args...]", "", "commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "smp-fx <command> --help for a command's options"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``smp-fx`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"smp-fx: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
