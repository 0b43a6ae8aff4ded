"""Writes kernel log records in /dev/kmsg format, so the exporter's real parser reads the simulator."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from gpuhealth.exporter.kmsg import split_record

log = logging.getLogger(__name__)


class KmsgWriter:
    """Appends ``pri,seq,usec,-;text`` records, continuing the sequence numbers already in the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seq = self._last_seq() + 1

    def _last_seq(self) -> int:
        try:
            with self.path.open("rb") as fh:
                lines = fh.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return -1
        seqs = [seq for line in lines if (seq := split_record(line)[0]) is not None]
        return max(seqs, default=-1)

    def write(self, text: str, priority: int = 3) -> None:
        usec = int(time.monotonic() * 1e6)
        with self._lock:
            try:
                with self.path.open("a") as fh:
                    fh.write(f"{priority},{self._seq},{usec},-;{text}\n")
            except OSError as exc:  # the simulated GPU still fails; only its log line is lost
                log.error("cannot write simulated kernel line path=%s error=%s", self.path, exc)
                return
            self._seq += 1
