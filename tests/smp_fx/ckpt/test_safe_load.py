"""The safe checkpoint loader: numpy values under numpy 1.x and 2.x (either spelling of
numpy's core in the file), and configuration classes from Hugging Face's dynamic-module
cache (``trust_remote_code``), only from there. Runs in both transformers environments."""

from __future__ import annotations

import importlib
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import smp_fx as smp
from smp_fx.ckpt.safe_load import read_file

_REMOTE = "transformers_modules.tiiuae.falcon_like.configuration_remote"
_CONFIG = """from transformers import PretrainedConfig


class RemoteConfig(PretrainedConfig):
    model_type = "remote_test"

    def __init__(self, width=4, **kwargs):
        self.width = width
        super().__init__(**kwargs)


class NotAConfig:
    pass
"""


def _respell(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite the module names a torch.save file's pickle refers to (protocol 2 names
    globals as text), as a file saved under the other numpy would have them."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in entries:
            z.writestr(info, data.replace(old, new) if info.filename.endswith(".pkl")
                       else data)


@pytest.mark.parametrize("spelling", [b"numpy.core.multiarray", b"numpy._core.multiarray"])
def test_numpy_values_load_under_either_spelling(tmp_path: Path, spelling: bytes) -> None:
    value = {"rng": np.random.RandomState(0).get_state()[1][:4], "loss": np.float32(0.5),
             "step": np.int64(3)}
    path = tmp_path / "state.pt"
    torch.save(value, path)
    for current in (b"numpy.core.multiarray", b"numpy._core.multiarray"):
        _respell(path, current, spelling)
    assert spelling in zipfile.ZipFile(path).read("state/data.pkl")
    loaded = read_file(str(path))
    assert np.array_equal(loaded["rng"], value["rng"])
    assert loaded["loss"] == value["loss"] and loaded["step"] == value["step"]


@pytest.fixture
def dynamic_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Hugging Face dynamic-module cache holding one fetched module, as
    ``trust_remote_code`` leaves it; its packages forgotten afterwards."""
    dyn = pytest.importorskip("transformers.dynamic_module_utils")
    cache = tmp_path / "modules"
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(cache))
    repo = cache / "transformers_modules" / "tiiuae" / "falcon_like"
    repo.mkdir(parents=True)
    for folder in (repo.parent, repo):
        (folder / "__init__.py").write_text("")
    (repo / "configuration_remote.py").write_text(_CONFIG)
    monkeypatch.syspath_prepend(str(cache))
    yield cache
    for name in [n for n in sys.modules if n.startswith("transformers_modules")]:
        del sys.modules[name]


def _saved(path: Path, obj: object) -> str:
    torch.save({"user_content": {"config": obj}}, path)
    return str(path)


def test_a_configuration_class_from_the_dynamic_cache_loads(
        dynamic_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = importlib.import_module(_REMOTE)
    monkeypatch.delenv("SMP_FX_TRUST_CHECKPOINTS", raising=False)
    path = _saved(tmp_path / "config.pt", remote.RemoteConfig(width=7))
    other = _saved(tmp_path / "other.pt", remote.NotAConfig())
    del sys.modules[_REMOTE]
    loaded = read_file(path)["user_content"]["config"]  # imported again, from the cache
    assert type(loaded).__name__ == "RemoteConfig" and loaded.width == 7
    with pytest.raises(smp.SMPCheckpointError, match="refuses"):
        read_file(other)  # the same cache, not a configuration class


def test_a_dynamic_package_outside_the_cache_is_refused(
        dynamic_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = importlib.import_module(_REMOTE)
    monkeypatch.delenv("SMP_FX_TRUST_CHECKPOINTS", raising=False)
    path = _saved(tmp_path / "config.pt", remote.RemoteConfig())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dynamic_cache / "transformers_modules").rename(elsewhere / "transformers_modules")
    for name in [n for n in sys.modules if n.startswith("transformers_modules")]:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(elsewhere))  # found first, but not in the cache
    with pytest.raises(smp.SMPCheckpointError, match="refuses"):
        read_file(path)
