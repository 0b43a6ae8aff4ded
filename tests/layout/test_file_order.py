"""The order test files start in (tests/file_order.py): longest first, files kept whole."""

from __future__ import annotations

from file_order import longest_first, merged


def test_the_longest_file_starts_first_and_each_file_stays_whole_and_in_order():
    items = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "c.py::t3"]
    known = {"a.py": 5.0, "b.py": 1.0, "c.py": 30.0}
    assert longest_first(items, str, known) == ["c.py::t1", "c.py::t2", "c.py::t3", "a.py::t1", "a.py::t2",
                                                "b.py::t1"]


def test_a_file_not_measured_yet_counts_as_the_longest():
    items = ["a.py::t", "new.py::t", "b.py::t"]
    assert longest_first(items, str, {"a.py": 5.0, "b.py": 9.0}) == ["new.py::t", "b.py::t", "a.py::t"]
    assert longest_first(items, str, {}) == items


def test_a_run_updates_the_files_it_measured_and_keeps_the_others():
    assert merged({"a.py": 5.0, "b.py": 9.0}, {"b.py": 3.14159, "c.py": 2.0}) == \
        {"a.py": 5.0, "b.py": 3.1, "c.py": 2.0}
