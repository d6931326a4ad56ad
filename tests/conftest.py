"""Shared pytest fixtures: a fixed seed and no smp state left behind for every test, one
intra-op thread where asked, and a check that a test which starts processes is marked.

* ``_seed``: ``torch.manual_seed(0)`` before every test.
* ``_no_smp_state_left``: after every test, ``smp.reset()`` and the process's smp state
  forgotten (``smp.init``'s configuration and process groups), so each test starts
  uninitialised whatever the one before it did or failed to do.
* ``one_thread``: one intra-op thread for the test (restored after). The machine is shared
  and the in-process pipeline's step threads add their own; ask for it with
  ``pytestmark = pytest.mark.usefixtures("one_thread")`` or as a fixture argument.
  (Ranks started by ``tests.helpers.dist.run_ranks`` get one thread on their own.)
* ``check_order``: the ranks ``tests.helpers.dist.run_ranks`` starts run under
  ``SMP_FX_CHECK_ORDER=1`` (NCCL's ordering rule checked at every step's end; a sample of
  the multi-process tests asks for it, the whole grid runs under it with the variable set).
* ``_trace_memo_per_file``: the programs ``passes.trace_memo`` remembers are forgotten at
  each test file's start, so what a file's tests see of the memo does not depend on which
  file ran before it on the worker.
* ``_spawning_is_marked``: a test that starts a process (a ``subprocess`` or a
  ``multiprocessing`` process, e.g. the ranks of ``run_ranks``) must carry
  ``@pytest.mark.multiproc``, so ``-m "not multiproc"`` runs in this process only.

``make test`` runs the suite on two pytest-xdist workers with ``--dist loadfile``: each test
file runs whole on one worker, so a file's batched spawn (``run_ranks`` results kept in a
module-level cache for its parametrized tests) runs once. (``--dist loadgroup`` with
``xdist_group`` marks groups nothing under pytest 9.2, pytest-xdist issue 1386: the tests
went one by one to either worker, and such a spawn ran once on each.) The files go longest
first (``tests/helpers/file_order.py``, a plugin of the root ``conftest.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from passes import trace_memo
from tests.helpers.processes import recording_processes


def pytest_sessionstart(session: pytest.Session) -> None:
    try:
        import matplotlib.font_manager  # noqa: F401  (builds the font list once per machine)
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_smp_state_left() -> Iterator[None]:
    yield
    if "smp_fx.world.state" not in sys.modules:
        return  # this process never imported smp_fx: nothing to forget
    import smp_fx
    from smp_fx.world import state

    smp_fx.reset()
    state._reset()


@pytest.fixture(autouse=True, scope="module")
def _trace_memo_per_file() -> Iterator[None]:
    """A test file starts without programs another file's tests exported
    (``passes.trace_memo``): its tests share them, as one process of a user's would."""
    trace_memo.clear()
    yield


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def check_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMP_FX_CHECK_ORDER", "1")


@pytest.fixture(autouse=True)
def _spawning_is_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Record every process the test starts (it still starts); fail at teardown when there
    was one and the test is not marked ``multiproc``."""
    with recording_processes() as started:
        yield
    if started and request.node.get_closest_marker("multiproc") is None:
        pytest.fail(f"{request.node.nodeid} started {len(started)} process(es) "
                    f"({started[0]}, ...) without @pytest.mark.multiproc: mark it, so "
                    "-m 'not multiproc' runs in one process", pytrace=False)
