"""The order ``conftest.py``'s plugin (tests/helpers/file_order.py) runs the files in:
longest recorded first, then most tests, each file whole and in its own order."""

from __future__ import annotations

import pytest

from tests.helpers.file_order import longest_first, read_table


def test_longest_first_keeps_files_whole_and_in_order() -> None:
    ids = ["a.py::t1", "b.py::t1", "b.py::t2", "c.py::t1", "a.py::t2", "d.py::t1",
           "d.py::t2", "d.py::t3", "e.py::t1"]
    order = [ids[i] for i in longest_first(ids, {"c.py": 90.0, "e.py": 120.0, "x.py": 5.0})]
    assert order == ["e.py::t1", "c.py::t1", "d.py::t1", "d.py::t2", "d.py::t3",
                     "a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2"]
    assert longest_first(["b.py::t1", "a.py::t1", "a.py::t2"], {}) == [1, 2, 0]
    assert longest_first(["b.py::t1", "a.py::t1"], {}) == [0, 1]  # ties: as collected


def test_the_table_records_seconds_of_test_files(request: pytest.FixtureRequest) -> None:
    seconds = read_table()
    assert seconds and all(s >= 0 for s in seconds.values())
    root = request.config.rootpath
    assert all((root / f).suffix == ".py" for f in seconds), sorted(seconds)
