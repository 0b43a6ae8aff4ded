"""Reading a file an operator names: bounded, regular files and pipes only, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpuhealth.contract.files import read_text


def test_a_small_file_is_read_and_a_fifo_without_a_writer_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / "ok.yaml").write_text("backend: sim\n")
    assert read_text(tmp_path / "ok.yaml") == "backend: sim\n"
    os.mkfifo(tmp_path / "fifo")
    assert read_text(tmp_path / "fifo") == ""  # nobody writes: empty at once, not a hang in open()


@pytest.mark.parametrize(("name", "message"), [
    ("/dev/zero", "is a device or socket, not a file"),
    ("dir", "Is a directory"),
    ("big", "larger than 1024 bytes"),
    ("latin1", "not UTF-8 text (byte 3)"),
])
def test_what_is_not_a_small_text_file_is_a_clear_oserror(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_text("x" * 1025)
    (tmp_path / "latin1").write_bytes(b"a: \xff\n")
    path = Path(name) if name.startswith("/") else tmp_path / name
    with pytest.raises(OSError) as caught:
        read_text(path, limit=1024)
    assert message in (caught.value.strerror or "")
