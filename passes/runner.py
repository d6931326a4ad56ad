"""The one pass runner: names, times and logs each pass and checks what it needs and gives.

After ``torch/fx/passes/infra/pass_manager.py``. Debug switches live here only:
``SMP_FX_DUMP_DIR`` writes each pass's graph, ``SMP_FX_VERIFY=1`` lints it and checks the
input was not mutated (docs/parameters.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.fx

from cost_model.errors import SMPError, SMPPassError
from passes.meta import MetaKey

log = logging.getLogger("smp_fx.passes")

PassFn = Callable[[torch.fx.GraphModule], torch.fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    """A named graph -> graph function with the meta keys it reads and writes."""

    name: str
    fn: PassFn
    requires: tuple[MetaKey[Any], ...] = ()
    provides: tuple[MetaKey[Any], ...] = ()


def _missing(gm: torch.fx.GraphModule, keys: Sequence[MetaKey[Any]]) -> list[str]:
    out = []
    for key in keys:
        lacking = [n.name for n in gm.graph.nodes if not key.has(n)]
        if lacking:
            out.append(f"{key.name} on {len(lacking)} node(s), e.g. {lacking[:3]}")
    return out


def _fingerprint(gm: torch.fx.GraphModule) -> tuple[Any, ...]:
    return tuple((n.name, n.op, str(n.target), tuple(sorted(n.meta))) for n in gm.graph.nodes)


def run_passes(gm: torch.fx.GraphModule,
               passes: Sequence[Pass | tuple[str, PassFn, Sequence[Any], Sequence[Any]]],
               dump_dir: str | os.PathLike[str] | None = None,
               verify: bool | None = None) -> torch.fx.GraphModule:
    """Run ``passes`` in order on ``gm`` and return the final GraphModule.

    ``passes`` holds ``Pass`` objects or ``(name, fn, requires, provides)`` tuples.
    ``dump_dir`` / ``verify`` default to ``SMP_FX_DUMP_DIR`` / ``SMP_FX_VERIFY``."""
    dump = dump_dir if dump_dir is not None else os.environ.get("SMP_FX_DUMP_DIR") or None
    check = verify if verify is not None else os.environ.get("SMP_FX_VERIFY", "") not in ("", "0")
    done: list[str] = []
    for index, item in enumerate(passes):
        p = item if isinstance(item, Pass) else Pass(item[0], item[1], tuple(item[2]),
                                                      tuple(item[3]))
        before = f"after passes {done}" if done else "as the first pass"
        missing = _missing(gm, p.requires)
        if missing:
            raise SMPPassError.build(f"pass {p.name!r} requires meta keys that are missing",
                                     "; ".join(missing), f"running {before}",
                                     "run the pass that provides them first")
        fingerprint = _fingerprint(gm) if check else None
        t0 = time.perf_counter()
        try:
            result = p.fn(gm)
        except SMPError:
            log.error("pass %r failed (%s)", p.name, before)
            raise
        except Exception as exc:
            raise SMPPassError.build(f"pass {p.name!r} failed", f"{type(exc).__name__}: {exc}",
                                     f"running {before}") from exc
        elapsed = time.perf_counter() - t0
        if not isinstance(result, torch.fx.GraphModule):
            raise SMPPassError.build(f"pass {p.name!r} must return a GraphModule",
                                     type(result).__name__, f"running {before}")
        missing = _missing(result, p.provides)
        if missing:
            raise SMPPassError.build(f"pass {p.name!r} did not provide the meta keys it promised",
                                     "; ".join(missing), f"running {before}")
        if check:
            result.graph.lint()
            if result is gm or _fingerprint(gm) != fingerprint:
                raise SMPPassError.build(f"pass {p.name!r} mutated its input GraphModule",
                                         where=f"running {before}",
                                         fix="copy it first (passes.graph_utils)")
        log.info("pass %s: %.3f s, %d nodes", p.name, elapsed, len(result.graph.nodes))
        if dump:
            path = Path(dump)
            path.mkdir(parents=True, exist_ok=True)
            (path / f"{index:02d}_{p.name}.txt").write_text(str(result.graph))
        done.append(p.name)
        gm = result
    return gm
