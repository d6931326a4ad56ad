"""torchrun that also records how each failed worker ended (its exit code or signal), so
``smp-fx run``'s summary tells a killed rank from those the launcher stopped after it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from torch.distributed import run as torch_run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from smp_fx.world import reports


def main(argv: Sequence[str]) -> None:
    try:
        torch_run.main(list(argv))
    except ChildFailedError as exc:
        root = os.environ.get(reports.ENV)
        if root:
            reports.record_exits(root, {int(r): int(f.exitcode)
                                        for r, f in exc.failures.items()})
        raise


def exit_without_teardown(code: int) -> NoReturn:
    """End a single-node agent once torchrun has returned, skipping the interpreter's
    teardown.

    The workers are reaped, the rendezvous is shut down and the reports are written; what
    is left is freeing the ~800 modules torch imported, which buys nothing: 0.45 CPU s and
    1-2 s of wall time per launch on a loaded 2-core machine (docs/performance.md). The
    ``atexit`` handlers still run and every stream and log handler is flushed, so nothing
    the agent wrote or registered is lost. Only with ``--standalone``: an agent of a
    multi-node job may host the rendezvous store the other agents still close theirs on.
    """
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch_run.parse_args(sys.argv[1:]).standalone:
        exit_without_teardown(0)
