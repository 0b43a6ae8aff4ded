"""Fixtures for the exporter tests; the helpers live in exporter_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from exporter_helpers import PROCFS, FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def procfs() -> Path:
    return PROCFS
