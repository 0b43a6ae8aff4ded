"""Session fixtures for the Ansible collection: an offline wheelhouse, the collection on a private
collections path, and a runner for ansible-playbook/ansible-lint with isolated state."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from wheelhouse import ROOT, build_wheelhouse

COLLECTION = ROOT / "ansible"
BIN = Path(sys.executable).parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


RECAP = re.compile(r"^(?P<host>\S+)\s+:\s+(?P<counts>(?:\w+=\d+\s*)+)$", re.MULTILINE)


@dataclass
class PlaybookRun:
    rc: int
    output: str

    def stats(self, host: str = "localhost") -> dict[str, int]:
        """The PLAY RECAP counters of ``host`` (ok, changed, failed, ...)."""
        for match in RECAP.finditer(self.output):
            if match["host"] == host:
                return {k: int(v) for k, v in (pair.split("=") for pair in match["counts"].split())}
        raise AssertionError(f"no PLAY RECAP line for {host}:\n{self.output[-3000:]}")

    def changed_tasks(self) -> list[str]:
        """Names of the tasks that reported a change, for assertion messages."""
        tasks = re.split(r"^TASK \[", self.output, flags=re.MULTILINE)[1:]
        return [t.split("]", 1)[0] for t in tasks if re.search(r"^changed:", t, re.MULTILINE)]

    def failures(self) -> str:
        lines = [line for line in self.output.splitlines()
                 if line.startswith(("fatal:", "failed:", "ERROR!"))]
        return "\n".join(lines) or self.output[-3000:]


@pytest.fixture(scope="session")
def ansible_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for ansible commands: the collection under its FQCN, state kept in a temp dir."""
    base = tmp_path_factory.mktemp("ansible-home")
    namespace = base / "collections" / "ansible_collections" / "gpuhealth"
    namespace.mkdir(parents=True)
    (namespace / "gpuhealth").symlink_to(COLLECTION)
    env = dict(os.environ)
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}{os.pathsep}/usr/sbin:/sbin",
        "ANSIBLE_COLLECTIONS_PATH": str(base / "collections"),
        "ANSIBLE_HOME": str(base / "home"),
        "ANSIBLE_LOCAL_TEMP": str(base / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(base / "remote-tmp"),
        "ANSIBLE_PIPELINING": "true",
        "ANSIBLE_RETRY_FILES_ENABLED": "false",
        "ANSIBLE_NOCOLOR": "true",
        "ANSIBLE_FORCE_COLOR": "false",
        "ANSIBLE_STDOUT_CALLBACK": "default",
        "ANSIBLE_DEPRECATION_WARNINGS": "false",
        "ANSIBLE_LOCALHOST_WARNING": "false",
    })
    return env


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("wheel-build")
    return build_wheelhouse(scratch / "wheelhouse", scratch)


def start_playbook(env: dict[str, str], inventory: Path, *args: str) -> subprocess.Popen[str]:
    """Start site.yml; independent runs (another prefix) may overlap to save wall time."""
    return subprocess.Popen(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(COLLECTION / "playbooks" / "site.yml"),
         *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish_playbook(proc: subprocess.Popen[str]) -> PlaybookRun:
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return PlaybookRun(proc.returncode, output)


def run_playbook(env: dict[str, str], inventory: Path, *args: str) -> PlaybookRun:
    return finish_playbook(start_playbook(env, inventory, *args))
