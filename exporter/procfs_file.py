"""One procfs file, read whole but bounded, as the collectors read it every second.

``--path.procfs`` may point at a tree that is not the kernel's (a container's bind mount, a test
fixture, a crafted directory), and ``/proc/<pid>/environ`` is as large as a job's owner makes it: a
regular file there can be any size, a FIFO would block a reader forever and ``/dev/zero`` never ends.
Only regular files are read (procfs serves its files as such), without blocking, up to a bound far
above what the kernel serves, like the sysfs reads (``sysfs_attribute``).
"""

from __future__ import annotations

import errno
import os
import stat

READ_BYTES = 1 << 16
# /proc/stat of a 512-CPU node with its interrupt counters is ~1 MiB, mountstats ~5 kB per NFS mount
PROCFS_FILE_BYTES = 16 << 20


def read_procfs(path: str | os.PathLike[str], limit: int = PROCFS_FILE_BYTES) -> str:
    """The text of one procfs file (bytes that are not UTF-8 kept as surrogates), through plain
    ``os.read`` calls, where pathlib's buffered text file costs more than the kernel's own work.
    ``OSError`` when it cannot be read, is not a regular file, or holds more than ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        chunks, size = [], 0
        while chunk := os.read(fd, READ_BYTES):
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"more than {limit} bytes", os.fspath(path))
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="surrogateescape")
