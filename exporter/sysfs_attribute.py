"""One sysfs attribute, read as the kernel serves it: at most one page, in one read.

``--path.sysfs`` may point at a tree that is not the kernel's (a container's bind mount, a test
fixture, a crafted directory): a regular file there can be any size and a FIFO would block a reader
forever. Reading one page without blocking keeps every such file to what a real attribute costs.
"""

from __future__ import annotations

import os

ATTRIBUTE_BYTES = 4096


def read_attribute(path: str | os.PathLike[str]) -> str:
    """The stripped text of one attribute (bytes that are not UTF-8 kept as surrogates); ``OSError``
    when it cannot be read (missing, a directory, a loop of links, a FIFO with no writer: EAGAIN)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        data = os.read(fd, ATTRIBUTE_BYTES)
    finally:
        os.close(fd)
    return data.decode(errors="surrogateescape").strip()
