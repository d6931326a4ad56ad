"""passes.export_cache: a graph stored on disk by one process is loaded by the next one
holding the same model, around that model's own tensors; what the key reads of the code;
files that do not load, directories that cannot be written, pruning."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from examples.models import hf_zoo
from passes import export_cache, trace_memo
from passes.export_cache import CacheStats
from passes.trace import trace
from tests.helpers.dist import run_ranks


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache of this test's own, nothing remembered in this process (so every trace
    that the cache does not serve is an export), counts from zero."""
    where = tmp_path / "cache"
    monkeypatch.setenv(export_cache.ENV, str(where))
    monkeypatch.setenv(trace_memo.ENV, "0")
    monkeypatch.setattr(export_cache, "STATS", CacheStats())
    return where


def _names(gm: torch.fx.GraphModule) -> list[str]:
    return [f"{n.op}:{n.target}" for n in gm.graph.nodes]


def test_a_model_of_other_weights_loads_the_stored_graph_with_its_own_tensors(
        _fresh: Path) -> None:
    first, second = hf_zoo.build("llama", seed=1), hf_zoo.build("llama", seed=2)
    x = hf_zoo.inputs("llama")
    exported = trace(first, x, frontend="export")
    assert export_cache.STATS.stored == 1 and len(list(_fresh.glob("*.graph"))) == 1
    loaded = trace(second, x, frontend="export")
    assert export_cache.STATS.loaded == 1
    assert export_cache.STATS.missed == {"not stored yet": 1}
    assert _names(loaded) == _names(exported)
    torch.testing.assert_close(loaded(*x), second(*x), rtol=0, atol=0)
    assert not torch.equal(loaded(*x), first(*x))
    mine = dict(second.named_parameters())
    assert all(p is mine[name] for name, p in loaded.named_parameters())


def _trace_in_a_new_process(where: str) -> tuple[int, bool]:
    os.environ[export_cache.ENV] = where
    os.environ[trace_memo.ENV] = "0"
    model, x = hf_zoo.build("t5", seed=3), hf_zoo.inputs("t5")
    before = export_cache.STATS.loaded  # the process it was forked from may have loaded
    gm = trace(model, x, frontend="export")
    return export_cache.STATS.loaded - before, bool(torch.equal(gm(*x), model(*x)))


@pytest.mark.multiproc
def test_another_process_loads_what_this_one_stored(_fresh: Path) -> None:
    """Another process hashes strings otherwise: the key must not depend on it
    (transformers' GenerationConfig keeps such a hash, ``trace_memo.PROCESS_HASHES``)."""
    trace(hf_zoo.build("t5", seed=1), hf_zoo.inputs("t5"), frontend="export")
    assert run_ranks(_trace_in_a_new_process, 1, str(_fresh), timeout=120) == [(1, True)]


_MODULE = '''
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) * {scale}
'''


def _write_package(root: Path, scale: float) -> None:
    pkg = root / "cachepkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(_MODULE.format(scale=scale))


def test_an_edited_model_file_is_a_new_key(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _write_package(tmp_path, 2.0)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("cachepkg")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("cachepkg.model")
    x = (torch.randn(3, 4),)
    before, _ = export_cache.cache_key(module.Scaled(), x, {})
    _write_package(tmp_path, 3.0)
    os.utime(tmp_path / "cachepkg" / "model.py", ns=(time.time_ns(), time.time_ns() + 10**9))
    module = importlib.reload(module)
    after, _ = export_cache.cache_key(module.Scaled(), x, {})
    assert before is not None and after is not None and before != after
    gm = trace(module.Scaled(), x, frontend="export")
    assert export_cache.STATS.stored == 1
    assert export_cache.package_state("torch") == ("version", str(torch.__version__))
    assert export_cache.package_state("cachepkg")[0][0] == "files"
    del gm


def test_a_stored_file_that_does_not_load_is_exported_again_and_replaced(
        _fresh: Path) -> None:
    model, x = hf_zoo.build("gpt2", seed=1), hf_zoo.inputs("gpt2")
    key, _ = export_cache.cache_key(model, x, {})
    _fresh.mkdir()
    (_fresh / f"{key}.graph").write_bytes(b"not a graph")
    gm = trace(model, x, frontend="export")
    torch.testing.assert_close(gm(*x), model(*x), rtol=0, atol=0)
    (why,) = export_cache.STATS.missed
    assert why.startswith("stored graph did not load")
    assert export_cache.STATS.stored == 1
    trace(model, x, frontend="export")
    assert export_cache.STATS.loaded == 1


def test_a_directory_that_cannot_be_written_costs_only_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv(export_cache.ENV, str(blocked / "cache"))
    model, x = hf_zoo.build("gpt2", seed=1), hf_zoo.inputs("gpt2")
    with caplog.at_level(logging.INFO, logger="smp_fx.passes.trace"):
        for _ in range(2):
            gm = trace(model, x, frontend="export")
    torch.testing.assert_close(gm(*x), model(*x), rtol=0, atol=0)
    assert sum(export_cache.STATS.unstored.values()) == 2
    assert export_cache.STATS.stored == export_cache.STATS.loaded == 0
    said = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert len(said) == 1, said


def test_a_hooked_model_has_no_key_and_is_exported_each_time(_fresh: Path) -> None:
    model, x = hf_zoo.build("gpt2", seed=1), hf_zoo.inputs("gpt2")
    model.register_forward_hook(lambda mod, args, out: None)
    for _ in range(2):
        trace(model, x, frontend="export")
    (why,) = export_cache.STATS.missed
    assert why.startswith("no key: ") and "hook" in why
    assert export_cache.STATS.missed[why] == 2 and not _fresh.exists()


def test_prune_keeps_the_most_recently_used(tmp_path: Path) -> None:
    for i in range(5):
        f = tmp_path / f"{i}.graph"
        f.write_bytes(b"x")
        os.utime(f, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    (tmp_path / "other.txt").write_text("")
    assert export_cache.prune(tmp_path, keep=3) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2.graph", "3.graph", "4.graph",
                                                          "other.txt"]


def test_without_the_variable_there_is_no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(export_cache.ENV, "")
    assert export_cache.directory() is None

    def export() -> torch.fx.GraphModule:
        return torch.fx.symbolic_trace(nn.Linear(2, 2))

    assert export_cache.cached(export, nn.Linear(2, 2), (), {}) is export
