"""Kernel log parsing and following: XIDs, NVSwitch SXIDs, PCIe AER and fallen-off-the-bus lines.

The same code reads ``/dev/kmsg`` (one record per read) and a regular file in kmsg or plain text
format (followed like ``tail -f``), so the simulator's log exercises the production path.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpuhealth.exporter.metrics import RECOVERY_ACTIONS

log = logging.getLogger(__name__)

RECOVERY_ACTION_CODES = dict(enumerate(RECOVERY_ACTIONS))  # NVML codes, as XID 154 prints them

_KMSG_PREFIX = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;")
_PCI = r"(?:PCI:)?([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?"
_XID = re.compile(r"NVRM: Xid \(" + _PCI + r"\): (\d+),")  # the comma: a cut line is not XID 7
_XID_LOOSE = re.compile(r"NVRM: Xid\b")
_RECOVERY = re.compile(r"recovery action changed from (?:0x)?[0-9a-fA-F]+(?: \([^)]*\))? "
                       r"to (?:0x)?([0-9a-fA-F]+)")
_FALLEN = re.compile(r"NVRM: The NVIDIA GPU " + _PCI + r" .*has fallen off the bus")
_SXID = re.compile(r"(nvidia-nvswitch\d+): SXid \(" + _PCI + r"\): (\d+), (Non-fatal|Fatal)", re.IGNORECASE)
_AER = re.compile(r"\S+ " + _PCI + r": AER: PCIe Bus Error: severity=(Corrected|Uncorrected \(Non-Fatal\)|"
                  r"Uncorrected \(Fatal\))")
_AER_SEVERITY = {"Corrected": "corrected", "Uncorrected (Non-Fatal)": "uncorrected_non_fatal",
                 "Uncorrected (Fatal)": "uncorrected_fatal"}


def pci_bus_id(domain: str, bus: str, device: str, function: str | None = None) -> str:
    """Normalise a kernel PCI address to NVML's spelling, ``00000000:3B:00.0``."""
    return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{function or '0'}"


@dataclass(frozen=True)
class Event:
    """One classified kernel log line; ``kind`` is one of the ``gpuhealth_kmsg_lines_total`` results."""

    kind: str
    pci_bus_id: str = ""
    code: int = 0          # XID or SXID number
    severity: str = ""     # SXID: fatal/non_fatal; AER: corrected/...
    device: str = ""       # NVSwitch device name
    action: str = ""       # XID 154: the requested recovery action
    seq: int | None = None  # /dev/kmsg sequence number


def split_record(line: str) -> tuple[int | None, float | None, str]:
    """Split a kmsg record ``pri,seq,usec,flags;text`` into (seq, seconds since boot, text)."""
    match = _KMSG_PREFIX.match(line)
    if match is None:
        return None, None, line
    return int(match.group(2)), int(match.group(3)) / 1e6, line[match.end():]


def parse_line(line: str) -> Event:
    """Classify one kernel log line (with or without the kmsg prefix). Never raises."""
    seq, _, text = split_record(line.rstrip("\n"))
    if text.startswith(" ") or not text.strip():
        return Event("ignored", seq=seq)  # /dev/kmsg dictionary continuation lines and blanks
    if match := _XID.search(text):
        xid = int(match.group(5))
        action = ""
        if xid == 154:
            rec = _RECOVERY.search(text, match.end())
            action = RECOVERY_ACTION_CODES.get(int(rec.group(1), 16), "") if rec else ""
            if not action:
                return Event("malformed", seq=seq)
        return Event("xid", pci_bus_id(*match.group(1, 2, 3, 4)), code=xid, action=action, seq=seq)
    if _XID_LOOSE.search(text):
        return Event("malformed", seq=seq)
    if match := _FALLEN.search(text):
        return Event("fallen_off_bus", pci_bus_id(*match.group(1, 2, 3, 4)), seq=seq)
    if match := _SXID.search(text):
        severity = "fatal" if match.group(7).lower() == "fatal" else "non_fatal"
        return Event("sxid", pci_bus_id(*match.group(2, 3, 4, 5)), code=int(match.group(6)),
                     severity=severity, device=match.group(1).removeprefix("nvidia-"), seq=seq)
    if match := _AER.search(text):
        return Event("aer", pci_bus_id(*match.group(1, 2, 3, 4)), severity=_AER_SEVERITY[match.group(5)],
                     seq=seq)
    return Event("ignored", seq=seq)


class KmsgFollower:
    """Reads new kernel log records without blocking: ``/dev/kmsg`` or a growing regular file.

    Replay after restart: when ``state_file`` is given, the last sequence number handled is kept
    there (with the boot id) and records up to it are skipped; otherwise, and after a reboot, reading
    starts at the end of the log as it was at start-up.
    """

    def __init__(self, path: Path, state_file: Path | None = None, boot_id: str = "") -> None:
        self.path = Path(path)
        self.state_file = state_file
        self.boot_id = boot_id
        self._fd: int | None = None
        self._is_char_device = False
        self._partial = b""
        self._last_seq = self._load_seq()
        self._saved_seq = self._last_seq
        # Only what existed at start-up is old news: a log created later is read from its start.
        self._seek_end = self._last_seq is None and self.path.exists()
        if self.path.exists():  # "start-up" is now, not the first sampling run
            try:
                self._open()
            except OSError as exc:  # e.g. no permission; read_lines retries and reports it
                log.warning("kmsg unreadable path=%s error=%s", self.path, exc)

    def _load_seq(self) -> int | None:
        if self.state_file is None:
            return None
        try:
            boot_id, seq = self.state_file.read_text().split()
        except (OSError, ValueError):
            return None
        return int(seq) if boot_id == self.boot_id and seq.isdigit() else None

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        self._is_char_device = not os.path.isfile(self.path)
        if self._seek_end:
            os.lseek(fd, 0, os.SEEK_END)  # /dev/kmsg: after the last record; a file: its end
        self._fd = fd
        log.info("kmsg opened path=%s resume_seq=%s", self.path, self._last_seq)
        return True

    def read_lines(self, max_records: int = 10000) -> list[str]:
        """Every complete record available now, replayed ones removed."""
        if self._fd is None and not self._open():
            return []
        lines: list[str] = []
        for raw in self._read_raw(max_records):
            text = raw.decode("utf-8", errors="replace")
            seq, _, _ = split_record(text)
            if seq is not None:
                if self._last_seq is not None and seq <= self._last_seq:
                    continue
                self._last_seq = seq
            lines.append(text)
        return lines

    def _read_raw(self, max_records: int) -> list[bytes]:
        assert self._fd is not None
        if self._is_char_device:
            records = []
            while len(records) < max_records:
                try:
                    record = os.read(self._fd, 8192)
                    if not record:  # end of file: not /dev/kmsg after all (/dev/null, a pipe)
                        break
                    # one record per read: the message line, then " KEY=value" dictionary lines
                    records.append(record.split(b"\n", 1)[0])
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EPIPE:  # EPIPE: ring buffer overran us; the next read resyncs
                        raise
                    log.warning("kmsg overrun path=%s", self.path)
            return records
        if os.fstat(self._fd).st_size < os.lseek(self._fd, 0, os.SEEK_CUR):
            log.info("kmsg file truncated path=%s; reading from its start", self.path)
            os.lseek(self._fd, 0, os.SEEK_SET)
            self._partial = b""
        chunks = []
        while chunk := os.read(self._fd, 65536):
            chunks.append(chunk)
        data = self._partial + b"".join(chunks)
        *complete, self._partial = data.split(b"\n")
        return complete

    def save_state(self) -> None:
        """Persist the last sequence number, when it changed."""
        if self.state_file is None or self._last_seq is None or self._last_seq == self._saved_seq:
            return
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(f"{self.boot_id} {self._last_seq}\n")
        tmp.replace(self.state_file)
        self._saved_seq = self._last_seq

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
