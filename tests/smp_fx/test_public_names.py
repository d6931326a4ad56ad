"""``smp_fx``'s public names load on first use: every listed name resolves, a submodule
imported first does not hide the public name of its spelling, and ``import smp_fx`` (as
``smp-fx run``'s launcher does) imports no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import smp_fx

ROOT = Path(__file__).resolve().parents[2]
MODULE_NAMES = {"amp", "nn", "optimizers", "state"}  # SMP's namespaces, as modules


def test_every_public_name_resolves() -> None:
    for name in smp_fx.__all__:
        value = getattr(smp_fx, name)
        assert isinstance(value, types.ModuleType) == (name in MODULE_NAMES), name
        assert name in dir(smp_fx)
    star: dict[str, object] = {}
    exec("from smp_fx import *", star)
    assert set(smp_fx.__all__) <= set(star)


def test_a_submodule_bound_later_keeps_the_public_name() -> None:
    for name in ("step", "reset"):
        # what importing the submodule does (importlib's _find_and_load) when it is first
        # imported after ``import smp_fx``
        setattr(smp_fx, name, sys.modules[f"smp_fx.{name}"])
        assert callable(getattr(smp_fx, name)), name
        assert not isinstance(getattr(smp_fx, name), types.ModuleType), name


def test_other_submodules_are_attributes_and_unknown_names_are_not() -> None:
    assert smp_fx.topology is sys.modules["smp_fx.topology"]
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = smp_fx.no_such_name


@pytest.mark.multiproc
def test_the_launcher_imports_no_torch() -> None:
    code = ("import sys, smp_fx, smp_fx.cli.main, smp_fx.cli.run\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
