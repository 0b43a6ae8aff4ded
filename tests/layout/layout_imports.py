"""Every import statement of the repository's Python files, read with ``ast`` (nothing is executed)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# Folder -> the package it is installed as; the shared contract package counts even before it exists.
INSTALLED_AS = {"contract": "gpuhealth.contract"} | {folder: pkg for pkg, folder in PACKAGE_DIR.items()}


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # absolute dotted name, relative imports resolved

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: imports {self.module}"


def _package(path: Path) -> list[str]:
    """The dotted package a file belongs to, as installed."""
    parts = path.relative_to(ROOT).parent.parts
    if parts and parts[0] in INSTALLED_AS:
        return INSTALLED_AS[parts[0]].split(".") + list(parts[1:])
    return list(parts)


def imports(folder: str) -> Iterator[Import]:
    """The imports of every ``.py`` file under ``folder``, function-level ones included."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from (Import(path, node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = _package(path)
                    base = ".".join(package[:len(package) - node.level + 1])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                yield Import(path, node.lineno, module)
