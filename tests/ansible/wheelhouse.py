"""An offline wheelhouse for the roles' pip step: gpuhealth built from this checkout, plus its
runtime dependencies repacked from the test virtualenv, so that installing needs no package index."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
INSTALL_ONLY = {"INSTALLER", "REQUESTED", "direct_url.json"}  # written by the installer, not in the wheel


def build_gpuhealth_wheel(dest: Path, scratch: Path, version: str | None = None) -> Path:
    """Build the gpuhealth wheel from a copy of the checkout (an in-tree build would race other builds),
    optionally under another version number, as a release would."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    src = scratch / "src"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    if version is not None:
        pyproject = src / "pyproject.toml"
        text, count = re.subn(r'(?m)^version = ".*"$', f'version = "{version}"', pyproject.read_text(),
                              count=1)
        assert count == 1, "no version line in pyproject.toml"
        pyproject.write_text(text)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dest), str(src)], check=True, capture_output=True)
    return next(dest.glob("gpuhealth-*.whl"))


def runtime_closure(name: str) -> list[metadata.Distribution]:
    """The installed distributions ``name`` needs at run time (extras and foreign markers left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [Requirement(r) for r in metadata.requires(name) or [] if "extra ==" not in r]
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        dist = metadata.distribution(req.name)
        seen[key] = dist
        todo += [Requirement(r) for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(dist: metadata.Distribution, dest: Path) -> Path:
    """Rebuild a wheel from an installed distribution's RECORD (files outside site-packages dropped)."""
    site = Path(dist.locate_file(""))
    info = Path(dist._path)  # type: ignore[attr-defined]  # the .dist-info directory
    tag = next(line.split(": ", 1)[1].strip() for line in (info / "WHEEL").read_text().splitlines()
               if line.startswith("Tag: "))
    name = canonicalize_name(dist.metadata["Name"]).replace("-", "_")
    wheel = dest / f"{name}-{dist.version}-{tag}.whl"
    record_name = f"{info.name}/RECORD"
    rows = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for entry in dist.files or []:
            rel = entry.as_posix()
            path = site / rel
            if rel.startswith("..") or "__pycache__" in rel or rel == record_name or not path.is_file():
                continue
            if rel.startswith(f"{info.name}/") and Path(rel).name in INSTALL_ONLY:
                continue
            data = path.read_bytes()
            zf.writestr(rel, data)
            rows.append(f"{rel},{_record_hash(data)},{len(data)}")
        rows.append(f"{record_name},,")
        zf.writestr(record_name, "\n".join(rows) + "\n")
    return wheel


def build_wheelhouse(dest: Path, scratch: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    build_gpuhealth_wheel(dest, scratch)
    for dist in runtime_closure("gpuhealth"):
        repack(dist, dest)
    return dest


def upgrade_wheelhouse(wheelhouse: Path, dest: Path, scratch: Path, version: str) -> Path:
    """``wheelhouse`` with gpuhealth rebuilt as ``version``: what an upgrade rollout would ship."""
    dest.mkdir(parents=True)
    for wheel in wheelhouse.glob("*.whl"):
        if not wheel.name.startswith("gpuhealth-"):
            shutil.copy2(wheel, dest / wheel.name)
    build_gpuhealth_wheel(dest, scratch, version)
    return dest
