"""The simulator's control socket: what an operator's tool asks of the simulated hardware while the
exporter runs (a GPU reset, for ``gpuhealth-sim-reset``).

Faults are injected through the scenario file (SIGHUP); a reset needs an answer (done, or why not),
so it goes over a Unix socket beside the node's state, mode 0600: only the exporter's user can reset
its GPUs, as only root can run ``nvidia-smi -r``. One JSON line each way per connection.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from gpuhealth.exporter.sim.gpu import ResetRefused

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4096
TIMEOUT_SECONDS = 10.0


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
    except ValueError:
        return {"ok": False, "error": "the request is not JSON"}
    gpu = request.get("gpu") if isinstance(request, dict) else None
    if not isinstance(request, dict) or request.get("op") != "reset_gpu" or not isinstance(gpu, str):
        return {"ok": False, "error": 'expected {"op": "reset_gpu", "gpu": "<index or GPU-uuid>"}'}
    try:
        detail = nvml.reset_gpu(gpu)
    except ResetRefused as exc:
        log.warning("event=sim_gpu_reset gpu=%s ok=false error=%r", gpu, str(exc))
        return {"ok": False, "error": str(exc)}
    log.info("event=sim_gpu_reset gpu=%s ok=true", gpu)
    return {"ok": True, "detail": detail, "index": nvml.gpu_index(gpu)}


class ControlServer:
    """Serves the control socket at ``path`` on a daemon thread until ``close``."""

    def __init__(self, path: Path, nvml: Resettable) -> None:
        self.path = Path(path)

        class Handler(socketserver.StreamRequestHandler):
            timeout = TIMEOUT_SECONDS

            def handle(self) -> None:
                try:
                    line = self.rfile.readline(MAX_REQUEST_BYTES)
                except OSError:
                    return
                self.wfile.write(json.dumps(_answer(nvml, line)).encode() + b"\n")

        self.path.unlink(missing_ok=True)  # a socket left by an exporter that was killed
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
