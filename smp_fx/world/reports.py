"""Failure reports: how ``smp-fx run`` tells which rank failed first.

The first error printed is rarely the cause, so each rank leaves small JSON records and
``first_failure`` follows them from rank to rank. See docs/launch.md.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

ENV = "SMP_FX_REPORT_DIR"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
EXITS = "exits.json"
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # how torchrun stops the others


def attempt_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """This process's report folder, or None outside ``smp-fx run``."""
    env = os.environ if env is None else env
    root = env.get(ENV)
    if not root:
        return None
    return Path(root) / f"attempt{env.get(RESTART_ENV, '0')}"


def _write(rank: int, kind: str, record: dict[str, Any], first_only: bool = False) -> None:
    directory = attempt_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{rank}.{kind}.json"
        if first_only and path.exists():
            return
        tmp = directory / f".rank{rank}.{kind}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"rank": rank, "time": time.time(), **record}))
        os.replace(tmp, path)
    except OSError:  # a report must never hide the failure it reports
        pass


def started(rank: int, stage: int) -> None:
    _write(rank, "started", {"stage": stage, "pid": os.getpid()})


def failed(rank: int, stages: Sequence[int], exc: BaseException) -> None:
    """This rank's work ended with ``exc`` (the first report of a rank is kept)."""
    _write(rank, "failed", {"stages": list(stages), "error": type(exc).__name__,
                            "message": str(exc)[:4000],
                            "peer_rank": getattr(exc, "peer_rank", None)}, first_only=True)


def stalled(rank: int, stages: Sequence[int], record: str) -> None:
    _write(rank, "stalled", {"stages": list(stages), "record": record[:8000]})


def install_excepthook(rank: int, stage: int) -> None:
    """Report an error that ends the script on this rank, then print it as usual."""
    if attempt_dir() is None:
        return
    previous: Callable[..., Any] = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        failed(rank, [stage], exc)
        previous(kind, exc, tb)

    sys.excepthook = hook


# ---- the launcher's side ---------------------------------------------------------------
def record_exits(root: str | os.PathLike[str], exits: Mapping[int, int]) -> None:
    """torchrun's view of the last attempt: exit code per failed global rank (negative:
    killed by that signal)."""
    Path(root, EXITS).write_text(json.dumps({str(r): c for r, c in exits.items()}))


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def first_failure(directory: Path, exits: Mapping[int, int] | None = None) -> str | None:
    """One line on the rank that failed first in one attempt, or None if none failed."""
    by_kind: dict[str, dict[int, dict[str, Any]]] = {"started": {}, "failed": {},
                                                     "stalled": {}}
    for path in sorted(directory.glob("rank*.json")):
        name, kind = path.stem.split(".")[0], path.stem.split(".")[-1]
        data = _load(path)
        if data is not None and kind in by_kind and name[4:].isdigit():
            by_kind[kind][int(name[4:])] = data
    started, failed, stalled = by_kind["started"], by_kind["failed"], by_kind["stalled"]
    exits = dict(exits or {})
    killed_by_us = {r for r, c in exits.items() if -c in [s.value for s in LAUNCHER_SIGNALS]}
    if not failed and not stalled and not {r for r in exits if r not in killed_by_us}:
        return None

    def stage(r: int) -> str:
        s = started.get(r, {}).get("stage")
        return f"rank {r} (stage {s})" if s is not None else f"rank {r}"

    def end(r: int) -> int:
        """Follow "this rank points at that one" to a rank that points nowhere."""
        seen: list[int] = []
        while r not in seen:
            seen.append(r)
            peer = failed.get(r, {}).get("peer_rank")
            if peer is None or r in stalled:
                break
            r = peer
        return r

    if failed:
        r = end(min(failed, key=lambda x: failed[x]["time"]))
    elif stalled:
        r = min(stalled, key=lambda x: stalled[x]["time"])
    else:
        r = min(x for x in exits if x not in killed_by_us)
    after = sorted((x for x in failed if x != r and end(x) == r), key=lambda x: failed[x]["time"])
    then = f"; {', then '.join(f'rank {x}' for x in after)} failed because of it" if after else ""
    if r in stalled:
        record = stalled[r]["record"].splitlines()
        at = next((x.strip() for x in record if x.strip().startswith("next op")),
                  next((x.strip() for x in record if x.strip().startswith("at:")), record[0]))
        return f"{stage(r)} stopped first: no progress in its step ({at}){then}"
    if r in failed and failed[r].get("peer_rank") is None:
        first_line = failed[r]["message"].splitlines()[0] if failed[r]["message"] else ""
        return f"{stage(r)} failed first: {failed[r]['error']}: {first_line}{then}"
    how = _exit_words(exits[r]) if r in exits else "left no report (killed?)"
    return f"{stage(r)} failed first: its process {how}{then}"


def summary(root: str | os.PathLike[str]) -> list[str]:
    """A line per failed attempt of a run: which rank failed first."""
    base = Path(root)
    exits_data = _load(base / EXITS) or {}
    attempts = sorted(base.glob("attempt*"), key=lambda p: int(p.name[7:] or 0))
    lines = []
    for i, directory in enumerate(attempts):
        exits = ({int(k): int(v) for k, v in exits_data.items()}
                 if i == len(attempts) - 1 else {})
        line = first_failure(directory, exits)
        if line is None and i < len(attempts) - 1:  # it failed: torchrun restarted the job
            line = ("a rank failed, and none left a report (the launcher stopped them "
                    "first); torchrun's log names the first process that exited")
        if line is not None:
            lines.append(f"{directory.name}: {line}")
    return lines
