"""Following a kernel log file: tail -f semantics, partial lines, truncation, no replay after restart."""

from __future__ import annotations

import os
from pathlib import Path

from gpuhealth.exporter.kmsg import MAX_READ_BYTES, MAX_RECORD_CHARS, KmsgFollower


def append(path: Path, text: str) -> None:
    with path.open("a") as fh:
        fh.write(text)


def test_existing_content_is_skipped_and_new_lines_follow(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("3,1,10,-;old line\n")
    follower = KmsgFollower(log)
    assert follower.read_lines() == []
    append(log, "3,2,20,-;new line\n3,3,30,-;half")
    assert follower.read_lines() == ["3,2,20,-;new line"]
    append(log, " done\n")
    assert follower.read_lines() == ["3,3,30,-;half done"]
    assert follower.read_lines() == []


def test_a_log_created_after_start_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    follower = KmsgFollower(log)
    assert follower.read_lines() == []
    log.write_text("3,0,10,-;first\n")
    assert follower.read_lines() == ["3,0,10,-;first"]


def test_truncated_file_is_read_again_from_the_start(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    follower = KmsgFollower(log)
    log.write_text("plain line one\nplain line two\n")
    assert len(follower.read_lines()) == 2
    log.write_text("after rotation\n")
    assert follower.read_lines() == ["after rotation"]


def test_restart_with_state_resumes_after_the_last_sequence(tmp_path: Path) -> None:
    log, state = tmp_path / "kmsg", tmp_path / "kmsg.seq"
    follower = KmsgFollower(log, state, boot_id="boot-a")
    log.write_text("3,1,10,-;one\n3,2,20,-;two\n")
    assert len(follower.read_lines()) == 2
    follower.save_state()
    follower.close()
    append(log, "3,3,30,-;three\n")
    # a restarted exporter reads the whole file again (as /dev/kmsg replays its ring) but skips seq <= 2
    restarted = KmsgFollower(log, state, boot_id="boot-a")
    assert restarted.read_lines() == ["3,3,30,-;three"]


def test_state_from_another_boot_is_ignored(tmp_path: Path) -> None:
    log, state = tmp_path / "kmsg", tmp_path / "kmsg.seq"
    state.write_text("boot-a 500\n")
    log.write_text("3,1,10,-;before start\n")
    follower = KmsgFollower(log, state, boot_id="boot-b")
    append(log, "3,2,20,-;after start\n")
    assert follower.read_lines() == ["3,2,20,-;after start"]  # seq 2 < 500 still counts: new boot


def test_a_device_at_end_of_file_yields_nothing() -> None:
    follower = KmsgFollower(Path("/dev/null"))
    assert follower.read_lines() == [] and follower.read_lines() == []
    follower.close()


def test_binary_garbage_does_not_stop_following(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    follower = KmsgFollower(log)
    log.write_bytes(b"\xff\xfe\x00garbage\n3,5,1,-;NVRM: ok\n")
    lines = follower.read_lines()
    assert lines[-1] == "3,5,1,-;NVRM: ok" and len(lines) == 2


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_fifo_path_is_read_without_leaking_file_handles(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    follower = KmsgFollower(fifo)
    before = _open_fds()
    for _ in range(20):
        assert follower.read_lines() == []
    assert _open_fds() == before
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(writer, b"3,1,10,-;NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception\n")
        assert follower.read_lines() == ["3,1,10,-;NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception"]
    finally:
        os.close(writer)
        follower.close()


def test_a_rotated_log_is_finished_then_followed_by_inode(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    follower = KmsgFollower(log)
    append(log, "before rotation\nlast line of the old file\n")
    log.rename(tmp_path / "kern.log.1")
    append(tmp_path / "kern.log.1", "written late to the old file\n")
    log.write_text("first line of the new file\n")
    assert follower.read_lines() == ["before rotation", "last line of the old file",
                                     "written late to the old file", "first line of the new file"]
    append(log, "second line\n")
    assert follower.read_lines() == ["second line"]


def test_reads_are_bounded_per_run_and_an_endless_line_is_cut(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    follower = KmsgFollower(log)
    append(log, "x" * (3 * MAX_READ_BYTES))  # no newline at all
    lines = follower.read_lines()  # the first MAX_READ_BYTES of it
    assert [len(line) for line in lines] == [MAX_RECORD_CHARS]  # one record's worth, once
    assert len(follower._partial) <= MAX_RECORD_CHARS
    append(log, "tail of the endless line\nnext\n")
    later = [line for _ in range(4) for line in follower.read_lines()]  # the rest, over a few runs
    assert later == ["next"]
