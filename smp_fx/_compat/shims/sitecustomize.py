"""Started in every process ``smp-fx run`` launches (the shim directory is on its
``PYTHONPATH``, and Python imports ``sitecustomize`` at start-up): registers smp-fx's
post-import hooks for the Hugging Face Trainer (``smp_fx_import_hooks``), then runs the
``sitecustomize`` this one shadows, if there is one. Nothing else is imported here."""

import importlib.machinery
import importlib.util
import os
import sys

import smp_fx_import_hooks  # type: ignore[import-not-found]  # a top-level shim module

smp_fx_import_hooks.install()


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed()
