"""Any test directories run together in one pytest process: a directory without ``__init__.py`` is put
on ``sys.path`` as it is collected, so its modules are imported by bare name, and two of one name (or a
test importing ``conftest``, of which every directory has its own) would find another directory's."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from layout_imports import ROOT

TESTS = ROOT / "tests"
IMPORTS_CONFTEST = re.compile(r"^\s*(?:from\s+conftest\s+import|import\s+conftest\b)", re.MULTILINE)


def _test_modules() -> list[Path]:
    """The modules of test directories that are not packages (fixture trees are data, not code)."""
    return [path for path in sorted(TESTS.rglob("*.py"))
            if not (path.parent / "__init__.py").exists()
            and not any(part == "fixtures" or part.endswith("_fixtures") for part in path.parts)]


def test_no_test_imports_conftest_by_name():
    importing = [str(p.relative_to(ROOT)) for p in _test_modules() if IMPORTS_CONFTEST.search(p.read_text())]
    assert importing == [], "import shared helpers from a module of their own (e.g. webhook_helpers)"


def test_modules_imported_by_bare_name_are_unique_across_test_directories():
    folders: defaultdict[str, list[str]] = defaultdict(list)
    for path in _test_modules():
        if path.name != "conftest.py":  # pytest loads each by its path
            folders[path.stem].append(str(path.parent.relative_to(ROOT)))
    assert {name: where for name, where in folders.items() if len(where) > 1} == {}
