"""Reading a file an operator names (a configuration, a scenario, a secret) without trusting the name.

A path is typed by hand: ``--config /dev/zero``, a directory or a log file by mistake must give a clear
error, not fill memory or hang. Only regular files and pipes (``<(...)``, a FIFO) are read, at most
``limit`` bytes of UTF-8; anything else is an ``OSError`` whose ``strerror`` says why, as ``open``
failures do. A configuration's YAML is parsed refusing a key given twice: YAML keeps the last one
silently, so a careless second ``token_file:`` or ``gpus_expected:`` would quietly win. Aliases are
bounded too: nine levels of nine aliases each (a "billion laughs" in 300 bytes) would have
validation walk 387 million nodes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import yaml

MAX_FILE_BYTES = 1 << 20  # far above any configuration, scenario or secret gpuhealth reads
MAX_YAML_NODES = 1_000_000  # nodes once aliases are expanded; a 1 MiB file without aliases has fewer


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


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes the document holds with every alias expanded, each shared node counted once
    per use but visited once (no recursion: a deeply nested document must not overflow the stack)."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()  # a recursive alias (a node holding itself) is counted once, not walked
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes or (not children_done and id(node) in entered):
            continue
        entered.add(id(node))
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        if children_done or not children:
            sizes[id(node)] = min(1 + sum(sizes.get(id(child), 0) for child in children), MAX_YAML_NODES + 1)
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in entered)
    return sizes[id(root)]


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names one key twice and a document whose aliases
    expand past ``MAX_YAML_NODES``."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None and _expanded_nodes(node) > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand past {MAX_YAML_NODES} nodes (an alias bomb?)", node.start_mark)
        return node

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
    """``yaml.safe_load``, with a key given twice in one mapping, an alias bomb or nesting too deep
    for PyYAML's recursive composer a ``yaml.YAMLError``."""
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader subclass: no arbitrary objects
    except RecursionError:  # PyYAML composes recursively: ~1,000 levels of nesting exhaust the stack
        raise yaml.YAMLError("nested too deeply") from None
