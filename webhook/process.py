"""The one way the webhook runs a program: no shell, its own process group, a deadline.

The command backend, the site commands of the other backends and the undrain health check all run
through ``run``: the program leads a new process group, so that at the deadline (or when the
webhook cancels the step) the whole tree is killed, not only the program we started, and a
``HelperRegistry`` may record the group while it runs for a restarted webhook to kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuhealth.webhook.backends.helpers import HelperRegistry


class NotStarted(Exception):
    """The program did not run to its end: it could not be started (``permanent``: missing, not
    executable) or its process group could not be recorded."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class TimedOut(Exception):
    """The program ran past its deadline; its process group was killed."""


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: bytes
    stderr: bytes  # empty when stderr was merged into stdout


async def run(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, merge_stderr: bool = False,
              helpers: HelperRegistry | None = None) -> Finished:
    """Run ``argv`` to its end or its deadline; ``NotStarted`` or ``TimedOut`` when it did not finish."""
    try:  # the record is made before the program starts: filling it in then needs no new space
        slot = helpers.reserve() if helpers is not None else None
    except OSError as exc:
        raise NotStarted(f"not run, its process cannot be recorded: {exc}") from None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    except OSError as exc:
        if helpers is not None and slot is not None:
            helpers.release(slot)
        raise NotStarted(f"cannot run {argv[0]!r}: {exc.strerror}", permanent=True) from None
    try:
        if helpers is not None and slot is not None:
            helpers.started(slot, proc.pid)
        async with asyncio.timeout(timeout):
            stdout, stderr = await proc.communicate()
    except (OSError, asyncio.CancelledError) as exc:  # TimeoutError is an OSError
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if isinstance(exc, TimeoutError):
            raise TimedOut(f"timed out after {timeout:g}s") from None
        if isinstance(exc, OSError):  # a helper that could not be recorded must not run unrecorded
            raise NotStarted(f"cannot record the helper process: {exc}") from None
        raise
    finally:
        if helpers is not None:
            helpers.finished(proc.pid)
    assert proc.returncode is not None  # communicate() returned: the program has exited
    return Finished(proc.returncode, stdout, stderr or b"")
