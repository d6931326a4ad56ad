"""pytest setup shared by the test suite and the packages' ``>>>`` examples.

``make test`` collects ``tests/`` and, with ``--doctest-modules``, every module of
``smp_fx``, ``passes`` and ``cost_model`` (``testpaths`` and ``addopts`` in pyproject.toml),
so every example in a docstring runs. Importing a module to read its examples must be free
of side effects, which holds for all of them but the compatibility shims, ignored below.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from _pytest.doctest import DoctestItem

# the longest test files first (the order two pytest-xdist workers finish together in)
pytest_plugins = ["tests.helpers.file_order"]

GPU_TESTS_ENV = "SMP_FX_TEST_GPU"
"""``1``: keep the GPUs visible and run ``tests/smp_fx/test_cuda.py`` on them.

Otherwise the suite hides them (before anything imports torch), so ``make test`` on a GPU
machine runs what CI runs: single-process tests would place their stages on ``cuda:0``
against host references, and multi-process ones would pick NCCL, which needs a GPU per
rank. The GPU tests: ``SMP_FX_TEST_GPU=1 pytest -m gpu``."""
if os.environ.get(GPU_TESTS_ENV) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The smdistributed shims replace their own ``sys.modules`` entry with ``smp_fx`` and
# register a torch.distributed backend when imported; only ``smp-fx run``'s children import
# them (tests/smp_fx/cli/test_run.py runs scripts through them).
collect_ignore = ["smp_fx/_compat/shims"]


_CACHE = pytest.StashKey[str]()
"""The run's export cache directory, on the controlling process."""


def pytest_configure(config: pytest.Config) -> None:
    """One export cache for the run (``passes.export_cache``), made by the controlling
    process before it starts the workers, so both workers, the ranks they start and the
    scripts they launch share it: a model exported once in the run is loaded after. It is
    set whatever the caller's environment holds, and removed at the end;
    ``SMP_FX_TEST_EXPORT_CACHE=0`` runs without one (every capture exports)."""
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: the controller's variable is in its environment
    from passes.export_cache import ENV

    if os.environ.get("SMP_FX_TEST_EXPORT_CACHE") == "0":
        os.environ[ENV] = ""
        return
    where = tempfile.mkdtemp(prefix="smp_fx_export_cache_")
    os.environ[ENV] = where
    config.stash[_CACHE] = where


def pytest_unconfigure(config: pytest.Config) -> None:
    where = config.stash.get(_CACHE, None)
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(autouse=True)
def _examples_leave_no_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """An example may call ``smp.init`` as a user would; the tests that run after it in
    this process must not inherit that state or its process group."""
    yield
    if isinstance(request.node, DoctestItem):
        from smp_fx.world import state

        state._reset()
