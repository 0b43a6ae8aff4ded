"""The simulator's control socket: what an operator's tool asks of the simulated hardware while the
exporter runs (a GPU reset, for ``gpuhealth-sim-reset``).

Faults are injected through the scenario file (SIGHUP); a reset needs an answer (done, or why not),
so it goes over a Unix socket beside the node's state, mode 0600 and the peer's uid checked: only the
exporter's user (or root) can reset its GPUs, as only root can run ``nvidia-smi -r``. One JSON line
each way per connection; the GPU is held to the grammar ``nvidia-smi -i`` reads (an index or a UUID).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import stat
import struct
import threading
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from gpuhealth.contract.gpu import GPU
from gpuhealth.exporter.sim.gpu import ResetRefused

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4096
TIMEOUT_SECONDS = 10.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Resettable(Protocol):
    def reset_gpu(self, gpu: str) -> str: ...

    def gpu_index(self, gpu: str) -> int: ...


class ResetDone(NamedTuple):
    """A reset carried out: the GPU's index (the request may name it by UUID) and nvidia-smi's report."""

    gpu: int
    detail: str


class ControlError(Exception):
    """The simulator refused the request; the message says why."""


class Unreachable(ControlError):
    """No simulator answered on the socket."""


def _answer(nvml: Resettable, line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested deeper than Python recurses
        return {"ok": False, "error": "the request is not JSON"}
    gpu = request.get("gpu") if isinstance(request, dict) else None
    if not isinstance(request, dict) or request.get("op") != "reset_gpu" or not isinstance(gpu, str):
        return {"ok": False, "error": 'expected {"op": "reset_gpu", "gpu": "<index or GPU-uuid>"}'}
    if not GPU.fullmatch(gpu):
        log.warning("event=sim_gpu_reset gpu=%r ok=false error=invalid_gpu", gpu[:80])
        return {"ok": False, "error": f"gpu {gpu[:80]!r} is neither a GPU index nor a GPU-<uuid>"}
    try:
        detail = nvml.reset_gpu(gpu)
    except ResetRefused as exc:
        log.warning("event=sim_gpu_reset gpu=%r ok=false error=%r", gpu, str(exc))
        return {"ok": False, "error": str(exc)}
    log.info("event=sim_gpu_reset gpu=%r ok=true", gpu)
    return {"ok": True, "detail": detail, "index": nvml.gpu_index(gpu)}


def _peer_allowed(sock: socket.socket) -> bool:
    """The mode bits can be loosened by whoever owns the folder; the kernel's word on the peer cannot."""
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid in (os.geteuid(), 0)


def _remove_stale_socket(path: Path) -> None:
    """A socket left by an exporter that was killed goes; anything else at the path is an operator's
    mistake (a config pointing at a real file) and is refused, never deleted."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink()


class ControlServer:
    """Serves the control socket at ``path`` on a daemon thread until ``close``."""

    def __init__(self, path: Path, nvml: Resettable) -> None:
        self.path = Path(path)

        class Handler(socketserver.StreamRequestHandler):
            timeout = TIMEOUT_SECONDS

            def handle(self) -> None:
                if not _peer_allowed(self.request):
                    log.warning("event=sim_control_refused reason=peer_uid")
                    answer: dict[str, Any] = {"ok": False,
                                              "error": "only the exporter's user or root may reset its GPUs"}
                else:
                    try:
                        line = self.rfile.readline(MAX_REQUEST_BYTES)
                    except OSError:
                        return
                    answer = _answer(nvml, line)
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        _remove_stale_socket(self.path)
        old_umask = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        finally:
            os.umask(old_umask)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="sim-control", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def reset_gpu(path: Path, gpu: str, timeout: float = TIMEOUT_SECONDS) -> ResetDone:
    """Ask the simulator behind ``path`` to reset ``gpu``. Raises ``ControlError`` when the reset is
    refused, ``Unreachable`` when nothing answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(json.dumps({"op": "reset_gpu", "gpu": gpu}).encode() + b"\n")
            reply = sock.makefile("rb").readline(MAX_REQUEST_BYTES)
    except OSError as exc:
        raise Unreachable(f"cannot reach the simulator's control socket {path}: "
                          f"{exc.strerror or exc}") from None
    try:
        answer = json.loads(reply)
    except ValueError:
        raise Unreachable(f"the simulator at {path} gave no answer") from None
    if not isinstance(answer, dict) or not answer.get("ok"):
        raise ControlError(str(answer.get("error", "refused") if isinstance(answer, dict) else answer))
    index = answer.get("index")
    if not isinstance(index, int) or isinstance(index, bool):
        raise Unreachable(f"the simulator at {path} did not say which GPU it reset")
    return ResetDone(index, str(answer.get("detail", "")))
