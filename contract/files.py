"""Reading a file an operator names (a configuration, a scenario, a secret) without trusting the name.

A path is typed by hand: ``--config /dev/zero``, a directory or a log file by mistake must give a clear
error, not fill memory or hang. Only regular files and pipes (``<(...)``, a FIFO) are read, at most
``limit`` bytes of UTF-8; anything else is an ``OSError`` whose ``strerror`` says why, as ``open``
failures do.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 1 << 20  # far above any configuration, scenario or secret gpuhealth reads


def read_text(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> str:
    """The file's text; ``OSError`` when it is not a regular file or pipe, over ``limit`` or not UTF-8."""
    # O_NONBLOCK: opening a FIFO nobody writes to must not hang; reads block again below
    fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device or socket"
            raise OSError(errno.EINVAL, f"is {kind}, not a file")
        os.set_blocking(fd, True)
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes: not a file gpuhealth reads")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise OSError(errno.EILSEQ, f"not UTF-8 text (byte {exc.start})") from None
