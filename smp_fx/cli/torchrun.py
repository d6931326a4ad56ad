"""torchrun that also records how each failed worker ended (its exit code or signal), so
``smp-fx run``'s summary tells a killed rank from those the launcher stopped after it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

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


if __name__ == "__main__":
    main(sys.argv[1:])
