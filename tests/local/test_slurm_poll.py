"""A wait on Slurm that times out says what it last saw, so that a failure in a loaded run can be read
from its message alone."""

from __future__ import annotations

import pytest

from gpuhealth.local.slurm import _poll


def test_a_timed_out_wait_names_the_last_state_seen():
    states = iter(["DOWN+DRAIN", "DOWN*", "DOWN*"] + ["IDLE*"] * 100)
    with pytest.raises(TimeoutError, match=r"waiting for gpu03 back in service; last seen: IDLE\*"):
        _poll(lambda: next(states), lambda state: state == "IDLE", 0.5, "gpu03 back in service")


def test_a_wait_that_succeeds_returns_what_it_saw():
    states = iter(["DOWN", "IDLE"])
    assert _poll(lambda: next(states), lambda state: state == "IDLE", 5, "idle") == "IDLE"
