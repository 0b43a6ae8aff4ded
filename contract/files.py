"""Reading a file an operator names (a configuration, a scenario, a secret) without trusting the name.

A path is typed by hand: ``--config /dev/zero``, a directory or a log file by mistake must give a clear
error, not fill memory or hang. Only regular files and pipes (``<(...)``, a FIFO) are read, at most
``limit`` bytes of UTF-8; anything else is an ``OSError`` whose ``strerror`` says why, as ``open``
failures do. A configuration's YAML is parsed refusing a key given twice: YAML keeps the last one
silently, so a careless second ``token_file:`` or ``gpus_expected:`` would quietly win.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import yaml

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


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names one key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"key {key!r} is given twice",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load``, with a key given twice in one mapping a ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader subclass: no arbitrary objects
