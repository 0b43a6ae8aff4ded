#!/usr/bin/env bash
# mypy over every package as installed (gpuhealth.exporter is exporter/, ...: pyproject.toml's
# package-dir). mypy cannot follow setuptools' editable-install finder, so it reads a tree of symlinks
# with the installed layout under .venv, where its cache lives too; paths are reported as in the repo.
# Settings: [tool.mypy] in pyproject.toml. Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
state=.venv/typecheck
tree="$state/src"
rm -rf "$tree"
.venv/bin/python - "$tree" <<'PY'
import sys
import tomllib
from pathlib import Path

tree = Path(sys.argv[1])
dirs = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in sorted(dirs.items()):
    target = tree.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    for entry in Path(folder).resolve().iterdir():
        if not (target / entry.name).exists() and f"{package}.{entry.name}" not in dirs:
            (target / entry.name).symlink_to(entry)
PY
MYPYPATH="$tree" .venv/bin/mypy --cache-dir "$state/cache" -p gpuhealth "$@" \
  | sed -E "s#^$tree/gpuhealth/(exporter|webhook|rules|dashboards|contract)/#\1/#; s#^$tree/##"
