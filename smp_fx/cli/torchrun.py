"""torchrun that also records how each failed worker ended, for ``smp-fx run``'s summary.

``smp-fx run`` starts ``python -m smp_fx.cli.torchrun ...`` where it would start
``python -m torch.distributed.run ...``: the same launcher with the same options. When
workers fail, torchrun raises ``ChildFailedError`` holding each failed worker's exit code
(negative: the signal that killed it); those go to ``$SMP_FX_REPORT_DIR/exits.json``
(``smp_fx.world.reports``) before torchrun reports them as usual, so the summary can tell a
rank that was killed (SIGKILL, out of memory) from the ranks the launcher stopped after it
(SIGTERM).
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
