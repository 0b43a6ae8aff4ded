"""The webhook's log set-up: one line per record, without gathering what the format never shows."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import logging, sys
from gpuhealth.webhook.main import configure_logging
configure_logging(False)
records = []
logging.getLogger().handlers[0].addFilter(lambda record: records.append(record) or True)
logging.getLogger("gpuhealth.webhook.app").info("event=probe value=%r", "a\\nb")
record = records[0]
print(record.funcName, record.lineno, record.thread, record.process, sep="|")
"""


def test_records_skip_the_caller_lookup_and_stay_one_line() -> None:
    # a fresh interpreter: the set-up changes the logging module's globals, which pytest's own capture reads
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "(unknown function)|0|None|None"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ts=") and lines[0].endswith(r"event=probe value='a\nb'")
