"""Captured graphs kept on disk, so a later process holding the same model loads instead of
exporting.

Why: a job that restarts (after a fault, at a new world size, a script run again) captures
its model again, and torch.export's symbolic reasoning is the costliest part of a first
step: 0.7-9 CPU-s for a tiny Hugging Face model, minutes for a large one. Loading the graph
an earlier process exported costs a sixth of that (``passes.trace_share``, whose bytes are
what a file holds). ``SMP_FX_EXPORT_CACHE=DIR`` turns it on (off when unset or empty).

A file's name is a hash of what the graph depends on: ``passes.trace_share.digest`` (the
model's structure, tensor shapes, dtypes and devices, its inputs' shapes, autograd and
autocast state, torch's version) and the code that runs it, which the digest names but
does not read. For each top-level package of the model's module classes (and their bases)
and for ``passes`` (smp-fx's normalisation of the graph): an installed package's version;
a package outside site-packages (a user's project, an editable install) by the path,
modification time and size of every ``.py`` file under it, so an edited model file is a
new key. Code outside those packages that a forward calls (a helper module of another
project edited in place without a version change) is not read: point
``SMP_FX_EXPORT_CACHE`` elsewhere, or empty the directory, after such an edit.

The files are pickles (torch's graph pickler): loading one runs what it says, as loading
any pickle does, so the directory must be writable by you alone.

A file that does not load (another torch, a truncated write) is exported again and
replaced; a directory that cannot be written is said once and the export used as it is.
Files are written whole (a temporary file renamed), so processes sharing a directory never
read half a graph; at most ``MAX_FILES`` are kept, the least recently used removed.
``STATS`` counts loads, stores and misses by reason.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cost_model.errors import one_line

if TYPE_CHECKING:  # torch is imported where a graph is made or read, so that a launcher
    import torch.fx  # can name the cache without importing it (``smp_fx.cli.run``)
    from torch import nn

log = logging.getLogger("smp_fx.passes.trace")

ENV = "SMP_FX_EXPORT_CACHE"
MAX_FILES = 256
"""Graphs kept in one directory (0.3-1.3 MB each for the tiny zoo's models)."""
SUFFIX = ".graph"
_FORMAT = "smp-fx export cache 1"  # the bytes of passes.trace_share.to_bytes


@dataclass
class CacheStats:
    """Graphs this process loaded and stored, why the others were exported, and why an
    export was not stored."""

    loaded: int = 0
    stored: int = 0
    missed: Counter[str] = field(default_factory=Counter)
    unstored: Counter[str] = field(default_factory=Counter)


STATS = CacheStats()


def directory() -> Path | None:
    """The cache directory ``SMP_FX_EXPORT_CACHE`` names; None when unset or empty."""
    value = os.environ.get(ENV, "")
    return Path(value) if value else None


def cached(export: Callable[[], torch.fx.GraphModule], model: nn.Module,
           args: tuple[Any, ...], kwargs: dict[str, Any],
           where: Path | None = None) -> Callable[[], torch.fx.GraphModule]:
    """``export`` behind the cache in ``where`` (default: ``directory()``): a callable that
    loads the graph an earlier process stored for the same key, or exports and stores it.
    ``export`` itself when there is no cache."""
    where = where if where is not None else directory()
    if where is None:
        return export

    def run() -> torch.fx.GraphModule:
        key, why = cache_key(model, args, kwargs)
        if key is None:
            return _missed(export, f"no key: {why}")
        path = where / f"{key}{SUFFIX}"
        gm, why = _load(path, model)
        if gm is not None:
            return gm
        gm = _missed(export, why)
        _store(where, path, gm, model)
        return gm

    return run


def cache_key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[str | None, str]:
    """(file stem, "") for this model at these inputs, or (None, why it has none)."""
    from passes.trace_share import available, digest

    why = available()
    if why is not None:
        return None, why
    text, why = digest(model, args, kwargs)
    if text is None:
        return None, why
    code = tuple((top, package_state(top)) for top in sorted(_packages(model)))
    return hashlib.sha256(repr((_FORMAT, text, code)).encode()).hexdigest(), ""


def _packages(model: nn.Module) -> set[str]:
    """The top-level packages defining the model's module classes and their bases, and
    smp-fx's ``passes``."""
    tops = {"passes"}
    for cls in {type(m) for m in model.modules()}:
        tops.update(c.__module__.partition(".")[0] for c in cls.__mro__ if c is not object)
    return tops


def package_state(top: str) -> tuple[Any, ...]:
    """What of a top-level package's code a graph depends on: its version where it is
    installed with one, else its source files' paths, modification times and sizes."""
    mod = sys.modules.get(top)
    if mod is None:
        return ("not imported",)
    # a namespace package's path can name one directory twice (two sys.path entries)
    roots = sorted({os.path.realpath(p) for p in getattr(mod, "__path__", ())})
    if not roots:  # a one-file module
        file = getattr(mod, "__file__", None)
        return _stats([Path(file)], Path(file).parent) if file else ("built in",)
    version = getattr(mod, "__version__", None)
    if version is not None and all(_installed(r) for r in roots):
        return ("version", str(version))
    return tuple(_stats(sorted(Path(r).rglob("*.py")), Path(r)) for r in roots)


def _installed(root: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in Path(root).parts)


def _stats(files: list[Path], base: Path) -> tuple[Any, ...]:
    out = []
    for f in files:
        if "__pycache__" in f.parts:
            continue
        try:
            st = f.stat()
        except OSError:
            continue
        out.append((str(f.relative_to(base)), st.st_mtime_ns, st.st_size))
    return ("files", str(base), tuple(out))


def _load(path: Path, model: nn.Module) -> tuple[torch.fx.GraphModule | None, str]:
    """The graph stored at ``path`` around ``model``'s tensors, or (None, why not)."""
    from passes.trace_share import from_bytes

    start = time.perf_counter()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "not stored yet"
    except OSError as exc:
        return None, f"unreadable ({one_line(exc)})"
    try:
        gm = from_bytes(data, model)
    except Exception as exc:  # another torch's pickle, a truncated file: export again
        return None, f"stored graph did not load ({one_line(exc)})"
    try:
        os.utime(path)  # recently used: the last to be pruned
    except OSError:
        pass
    STATS.loaded += 1
    log.info("export: loaded the graph from the export cache (%s, %.2f s)", path,
             time.perf_counter() - start)
    return gm, ""


def _missed(export: Callable[[], torch.fx.GraphModule], why: str) -> torch.fx.GraphModule:
    """Export, counting why the cache did not serve it (said once per reason; a graph not
    stored yet is the cache's normal first use and is counted only)."""
    first = why not in STATS.missed
    STATS.missed[why] += 1
    if first and why != "not stored yet":
        log.info("export cache: exporting (%s)", why)
    return export()


def _store(where: Path, path: Path, gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Write the graph whole (a temporary file renamed), then prune; a failure is said
    once and costs only the next process its load."""
    from passes.trace_share import to_bytes

    temp: str | None = None
    try:
        data = to_bytes(gm, model)
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".tmp-", delete=False) as f:
            temp = f.name
            f.write(data)
        os.replace(temp, path)
    except Exception as exc:  # a full or read-only disk, a graph that cannot be pickled
        if temp is not None and os.path.exists(temp):
            os.unlink(temp)
        reason = one_line(exc)
        if reason not in STATS.unstored:
            log.info("export cache: the graph is not stored in %s (%s)", where, reason)
        STATS.unstored[reason] += 1
        return
    STATS.stored += 1
    prune(where)


def prune(where: Path, keep: int = MAX_FILES) -> int:
    """Remove all but the ``keep`` most recently used graphs; how many were removed."""
    files = []
    for f in where.glob(f"*{SUFFIX}"):
        try:
            files.append((f.stat().st_mtime_ns, f))
        except OSError:
            continue
    gone = 0
    for _, f in sorted(files, reverse=True)[keep:]:
        try:
            f.unlink()
            gone += 1
        except OSError:
            pass
    return gone


__all__ = ["ENV", "MAX_FILES", "STATS", "CacheStats", "cache_key", "cached", "directory",
           "package_state", "prune"]
