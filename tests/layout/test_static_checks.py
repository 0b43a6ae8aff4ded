"""The static checks test.sh runs: mypy strict on the daemons and gradual elsewhere, as configured in
pyproject.toml, and no silenced type error without its code and the reason beside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from layout_imports import ROOT

UNTYPED = "def double(value):\n    return value * 2\n"
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<rest>.*)$")
REASONED = re.compile(r"\[[a-z-]+(?:,\s*[a-z-]+)*\]\s+#\s*\S")


def test_mypy_is_strict_on_the_daemons_and_gradual_elsewhere(tmp_path):
    for package in ("exporter", "webhook", "evaluation", "rules"):
        (tmp_path / "gpuhealth" / package).mkdir(parents=True)
        (tmp_path / "gpuhealth" / package / "__init__.py").write_text("")
        (tmp_path / "gpuhealth" / package / "probe.py").write_text(UNTYPED)
    (tmp_path / "gpuhealth" / "__init__.py").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"), "-p", "gpuhealth"],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": str(tmp_path)}, capture_output=True, text=True,
        timeout=300)
    flagged = {Path(line.split(":")[0]).parent.name for line in result.stdout.splitlines()
               if "[no-untyped-def]" in line}
    assert flagged == {"exporter", "webhook"}, result.stdout + result.stderr


def test_every_type_ignore_names_its_code_and_reason():
    bare = []
    for folder in ("exporter", "webhook", "rules", "dashboards", "gpuhealth", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():  # its examples below
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                found = IGNORE.search(line)
                if found and not REASONED.match(found["rest"]):
                    bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert bare == []


def test_the_reason_check_tells_a_reasoned_ignore_from_a_bare_one():
    def reasoned(line: str) -> bool:
        found = IGNORE.search(line)
        return bool(found and REASONED.match(found["rest"]))

    assert reasoned("x = f()  # type: ignore[attr-defined]  # the C extension adds it at run time")
    assert not reasoned("x = f()  # type: ignore[attr-defined]")
    assert not reasoned("x = f()  # type: ignore")
    assert not reasoned("x = f()  # type: ignore  # because")
