"""The order test files run in: the longest first.

``./test.sh`` hands whole files to two workers (``--dist loadfile``) in collection order
(``--no-loadscope-reorder``: xdist's own order is by test count, which put the few-but-long files, a
backfilled Prometheus or an Ansible site run, last, while the other worker had nothing left). Starting
the longest files first lets the short ones fill in around them. Each file's seconds come from
``tests/file_durations.json``, written by a run with ``--store-durations``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from file_order import file_of, longest_first, merged

DURATIONS = Path(__file__).with_name("file_durations.json")


def _known() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test file's seconds (setup, call, teardown) to {DURATIONS.name}, "
                          "the order later runs start files in")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = longest_first(items, lambda item: item.nodeid, _known())


class DurationStore:
    """Adds up each file's test phases as their reports arrive (on xdist's controller, from every
    worker) and merges them into the durations file at the end of a run that passed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.OK:
            DURATIONS.write_text(json.dumps(merged(_known(), self.seconds), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationStore(), "gpuhealth-duration-store")
