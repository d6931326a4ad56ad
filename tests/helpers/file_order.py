"""Run the longest test files first, so that two pytest-xdist workers finish together.

``--dist loadfile`` hands files out in collection order, a worker taking the next one when
it runs short. pytest-xdist's own re-sorting by number of tests puts the one-test files that
run a whole training script (minutes each) last, where one worker runs them while the other
has nothing left; so it is turned off, and files go by the seconds
``tests/data/file_durations.json`` records, then by number of tests. ``pytest
--record-file-durations`` rewrites that table from the run (the plugin of ``conftest.py``).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

TABLE = Path(__file__).resolve().parents[1] / "data" / "file_durations.json"
OPTION = "--record-file-durations"
_seconds: defaultdict[str, float] = defaultdict(float)  # this run's, per file


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def read_table(path: Path = TABLE) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests); {} without a table."""
    if not path.exists():
        return {}
    return {k: float(v) for k, v in json.loads(path.read_text())["seconds"].items()}


def longest_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """Indices of ``nodeids`` with each file's tests kept together and in order, files by
    recorded seconds, then by number of tests, both descending, then as collected."""
    count = Counter(file_of(n) for n in nodeids)
    first: dict[str, int] = {}
    for i, n in enumerate(nodeids):
        first.setdefault(file_of(n), i)

    def key(i: int) -> tuple[float, int, int, int]:
        f = file_of(nodeids[i])
        return (-seconds.get(f, 0.0), -count[f], first[f], i)

    return sorted(range(len(nodeids)), key=key)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, action="store_true",
                     help=f"record each test file's seconds in {TABLE} after the run "
                     "(files this run did not run keep theirs)")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order made below


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = longest_first([item.nodeid for item in items], read_table())
    items[:] = [items[i] for i in order]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption(OPTION) and not hasattr(config, "workerinput"):
        seconds = {**read_table(), **{f: round(s, 1) for f, s in _seconds.items()}}
        TABLE.write_text(json.dumps({
            "about": "seconds per test file (all phases of its tests), written by pytest "
                     f"{OPTION}; tests/helpers/file_order.py runs the longest first",
            "seconds": dict(sorted(seconds.items()))}, indent=1) + "\n")

