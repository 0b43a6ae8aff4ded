"""Kernel log parsing and following: XIDs, NVSwitch SXIDs, PCIe AER and fallen-off-the-bus lines.

The same code reads ``/dev/kmsg`` (one record per read) and a regular file in kmsg or plain text
format (followed like ``tail -f``), so the simulator's log exercises the production path.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuhealth.exporter.metrics import RECOVERY_ACTIONS

log = logging.getLogger(__name__)

RECOVERY_ACTION_CODES = dict(enumerate(RECOVERY_ACTIONS))  # NVML codes, as XID 154 prints them

MAX_RECORD_CHARS = 4096  # the kernel's own limit is 1 KiB of text per record; more is not a kernel line
MAX_READ_BYTES = 1 << 20  # per sampling run from a file: a flood is read over several runs, in bounded memory

_DICTIONARY = re.compile(r" [A-Z_]{1,32}=")
_KMSG_PREFIX = re.compile(r"^(\d+),(\d+),(\d+),[^;]{0,16};")
# domain:bus:device[.function]; a device number is 0-1f (32 per bus), a function 0-7
_PCI = r"(?:PCI:)?([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([01]?[0-9a-fA-F])(?:\.([0-7]))?"
# Every pattern is matched at a position found with str.find, never searched across the record:
# the cost of a record is linear in its length whatever it contains.
_XID = re.compile(r"NVRM: Xid \(" + _PCI + r"\): (\d{1,5}),")  # the comma: a cut line is not XID 7
_RECOVERY = re.compile(r"recovery action changed from (?:0x)?[0-9a-fA-F]{1,8}(?: \([^)]{0,80}\))? "
                       r"to (?:0x)?([0-9a-fA-F]{1,8})")
# "NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330)\x0aNVRM: installed in this system has\x0a
# NVRM: fallen off the bus ..." (one record, newlines escaped by /dev/kmsg), and the shorter
# "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus." of newer drivers.
_FALLEN = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at )?" + _PCI + r"\b")
_SXID = re.compile(r"(nvidia-nvswitch\d{1,4}): SXid \(" + _PCI + r"\): (\d{1,6}), (Non-fatal|Fatal)",
                   re.IGNORECASE)
# The device before "PCIe Bus Error": "nvidia 0000:3b:00.0: AER: " (4.19+), "pcieport 0000:00:01.0: "
# (older kernels, no "AER: "), both within a few dozen characters of the phrase.
_AER_DEVICE = re.compile(_PCI + r": (?:AER: )?$")
_AER_SEVERITY = re.compile(r"severity=(Corrected|Correctable|Uncorrected|Uncorrectable)( \(Non-Fatal\)| "
                           r"\(Fatal\))?")
_DEVICE_WINDOW = 48


def unescape_record(text: str) -> str:
    """One kmsg record's text as one line: escaped newlines (``\\x0a``) and their ``NVRM: `` joined."""
    if "\\x0a" not in text:
        return text
    return " ".join(part.removeprefix("NVRM: ") if i else part
                    for i, part in enumerate(text.split("\\x0a")))


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


def _from_user_space(line: str) -> bool:
    """A kmsg record's facility (priority >> 3) is 0 only for the kernel: the kernel files whatever
    user space writes to /dev/kmsg under LOG_USER at least, so such a record cannot forge an XID."""
    match = _KMSG_PREFIX.match(line)
    return match is not None and int(match.group(1)) >> 3 != 0


def parse_line(line: str) -> Event:
    """Classify one kernel log line or kmsg record (prefix optional). Never raises; linear time."""
    line = line[:MAX_RECORD_CHARS].rstrip("\n")
    seq, _, text = split_record(line)
    if _from_user_space(line):
        return Event("not_kernel", seq=seq)
    if not text.strip() or _DICTIONARY.match(text):
        return Event("ignored", seq=seq)  # blanks and /dev/kmsg dictionary lines (" SUBSYSTEM=pci")
    text = unescape_record(text)
    if (at := text.find("NVRM: Xid")) >= 0:
        return _xid(text, at, seq)
    if (at := text.find("NVRM: ")) >= 0 and (match := _FALLEN.match(text, at)):
        pci = pci_bus_id(*match.group(1, 2, 3, 4))
        # the notice's first line alone (a text log splits the record): remembered by the caller
        return Event("fallen_off_bus" if "fallen off the bus" in text else "ignored", pci, seq=seq)
    if at >= 0 and text.startswith("NVRM: fallen off the bus", at):
        return Event("fallen_off_bus", "", seq=seq)  # the GPU is named on the notice's first line
    if (at := text.find(": SXid (")) >= 0:
        start = text.rfind("nvidia-nvswitch", max(at - 24, 0), at)
        if start >= 0:
            if (match := _SXID.match(text, start)) is None:
                return Event("malformed", seq=seq)
            severity = "fatal" if match.group(7).lower() == "fatal" else "non_fatal"
            return Event("sxid", pci_bus_id(*match.group(2, 3, 4, 5)), code=int(match.group(6)),
                         severity=severity, device=match.group(1).removeprefix("nvidia-"), seq=seq)
    if (at := text.find("PCIe Bus Error: ")) >= 0:
        return _aer(text, at, seq)
    return Event("ignored", seq=seq)


def _xid(text: str, at: int, seq: int | None) -> Event:
    match = _XID.match(text, at)
    if match is None:
        return Event("malformed", seq=seq)
    xid = int(match.group(5))
    action = ""
    if xid == 154:
        rec = _RECOVERY.search(text, match.end(), match.end() + 200)
        action = RECOVERY_ACTION_CODES.get(int(rec.group(1), 16), "") if rec else ""
        if not action:
            return Event("malformed", seq=seq)
    return Event("xid", pci_bus_id(*match.group(1, 2, 3, 4)), code=xid, action=action, seq=seq)


def _aer(text: str, at: int, seq: int | None) -> Event:
    """``<driver> <pci>: [AER: ]PCIe Bus Error: severity=<Corrected|Correctable|Uncorrected
    (Non-Fatal)|Uncorrectable (Fatal)|...>, type=..., (<agent> ID)``, from the device or its root port."""
    device = _AER_DEVICE.search(text[max(at - _DEVICE_WINDOW, 0):at])
    severity = _AER_SEVERITY.match(text, at + len("PCIe Bus Error: "))
    if device is None or severity is None:
        return Event("malformed", seq=seq)
    kind, qualifier = severity.group(1), severity.group(2) or ""
    if kind.startswith("Correct"):
        label = "corrected"
    else:
        label = "uncorrected_fatal" if qualifier == " (Fatal)" else "uncorrected_non_fatal"
    return Event("aer", pci_bus_id(*device.group(1, 2, 3, 4)), severity=label, seq=seq)


class KmsgFollower:
    """Reads new kernel log records without blocking: ``/dev/kmsg`` or a growing regular file.

    Replay after restart: when ``state_file`` is given, the last sequence number handled is kept
    there (with the boot id) and records up to it are skipped; otherwise, and after a reboot, reading
    starts at the end of the log as it was at start-up, or at its first record with ``from_start``
    (a one-shot reader such as ``gpuhealth-validate`` wants what the log holds since boot).
    """

    def __init__(self, path: Path, state_file: Path | None = None, boot_id: str = "",
                 from_start: bool = False) -> None:
        self.path = Path(path)
        self.state_file = state_file
        self.boot_id = boot_id
        self._fd: int | None = None
        self._is_char_device = False
        self._inode: tuple[int, int] | None = None
        self._partial = b""
        self._discarding = False
        self._last_seq = self._load_seq()
        self._saved_seq = self._last_seq
        # Only what existed at start-up is old news: a log created later is read from its start.
        self._seek_end = not from_start and self._last_seq is None and self.path.exists()
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
        try:
            st = os.fstat(fd)
            self._is_char_device = stat.S_ISCHR(st.st_mode)  # /dev/kmsg: one record per read
            self._inode = (st.st_dev, st.st_ino)
            if self._seek_end and not stat.S_ISFIFO(st.st_mode):  # a pipe has no end to seek to
                os.lseek(fd, 0, os.SEEK_END)  # /dev/kmsg: after the last record; a file: its end
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._seek_end = False  # a log that replaces this one (rotation) is read from its start
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
            return self._read_records(max_records)
        records = self._read_stream(max_records)
        if self._rotated():  # renamed away and replaced: the old file is finished, follow the new one
            log.info("kmsg file replaced path=%s; reading the new one from its start", self.path)
            records += self._read_stream(max_records)
            if self._partial:
                records.append(self._partial)
            self.close()
            self._partial, self._discarding = b"", False
            if self._open():
                records += self._read_stream(max_records)
        return records

    def _read_records(self, max_records: int) -> list[bytes]:
        fd = self._fd
        assert fd is not None, "read while closed"
        records: list[bytes] = []
        while len(records) < max_records:
            try:
                record = os.read(fd, 8192)
                if not record:  # end of file: not /dev/kmsg after all (/dev/null)
                    break
                # one record per read: the message line, then " KEY=value" dictionary lines
                records.append(record.split(b"\n", 1)[0][:MAX_RECORD_CHARS])
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.EPIPE:  # EPIPE: ring buffer overran us; the next read resyncs
                    raise
                log.warning("kmsg overrun path=%s", self.path)
        return records

    def _read_stream(self, max_records: int) -> list[bytes]:
        """Complete lines from a file or pipe: at most MAX_READ_BYTES a run, lines cut at the record cap."""
        fd = self._fd
        assert fd is not None, "read while closed"
        seekable = stat.S_ISREG(os.fstat(fd).st_mode)
        if seekable and os.fstat(fd).st_size < os.lseek(fd, 0, os.SEEK_CUR):
            log.info("kmsg file truncated path=%s; reading from its start", self.path)
            os.lseek(fd, 0, os.SEEK_SET)
            self._partial, self._discarding = b"", False
        records: list[bytes] = []
        budget = MAX_READ_BYTES
        while budget > 0 and len(records) < max_records:
            try:
                chunk = os.read(fd, min(65536, budget))
            except BlockingIOError:
                break
            if not chunk:
                break
            budget -= len(chunk)
            *complete, rest = (self._partial + chunk).split(b"\n")
            for line in complete:
                if self._discarding:  # the rest of an overlong line, already counted once
                    self._discarding = False
                    continue
                records.append(line[:MAX_RECORD_CHARS])
            if len(rest) > MAX_RECORD_CHARS:  # no newline in sight: keep one record's worth, drop the rest
                if not self._discarding:
                    records.append(rest[:MAX_RECORD_CHARS])
                self._discarding, rest = True, b""
            self._partial = rest
        return records

    def _rotated(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False  # renamed, not yet replaced: keep the old one
        return (st.st_dev, st.st_ino) != self._inode

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
