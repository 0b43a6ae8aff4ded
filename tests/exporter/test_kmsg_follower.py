"""Following a kernel log file: tail -f semantics, partial lines, truncation, no replay after restart."""

from __future__ import annotations

from pathlib import Path

from gpuhealth.exporter.kmsg import KmsgFollower


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
