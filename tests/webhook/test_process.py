"""The one program runner: no shell, the program's whole process group killed at its deadline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gpuhealth.webhook import process
from waiting import eventually


async def test_output_exit_status_and_merged_stderr():
    done = await process.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"")
    merged = await process.run(["sh", "-c", "echo a; echo b >&2"], timeout=30, merge_stderr=True)
    assert sorted(merged.stdout.split()) == [b"a", b"b"] and merged.stderr == b""


async def test_arguments_are_never_parsed_by_a_shell(tmp_path):
    done = await process.run(["echo", "$(touch pwned); `id`"], timeout=30, cwd=tmp_path)
    assert done.stdout == b"$(touch pwned); `id`\n" and list(tmp_path.iterdir()) == []


async def test_a_missing_program_is_a_permanent_not_started():
    with pytest.raises(process.NotStarted) as err:
        await process.run(["/nonexistent/site-tool"], timeout=30)
    assert err.value.permanent and "cannot run '/nonexistent/site-tool'" in str(err.value)


async def test_the_deadline_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = f"sleep 600 & echo $! > {pidfile}; wait"
    with pytest.raises(process.TimedOut, match="timed out after 1s"):
        await process.run(["sh", "-c", script], timeout=1)
    child = int(pidfile.read_text())

    async def gone() -> bool:
        stat = Path(f"/proc/{child}/stat")
        return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"

    await eventually(gone, timeout=10, what="the program's child to die with its group")
