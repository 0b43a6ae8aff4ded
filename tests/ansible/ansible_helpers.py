"""What the Ansible tests import: where the collection is, and running ansible-playbook on it. Tests
never import ``conftest`` by name: another directory's would answer when both directories run in one
pytest process."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from wheelhouse import ROOT

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


def start_playbook(env: dict[str, str], inventory: Path, *args: str) -> subprocess.Popen[str]:
    """Start site.yml; independent runs (another prefix) may overlap to save wall time."""
    return subprocess.Popen(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(COLLECTION / "playbooks" / "site.yml"),
         *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


# In whole-suite runs on 2 cores one site.yml run took about 4.5 minutes, and once over 5 (killed: rc -9
# midway through its output) while the other worker backfilled a fleet into Prometheus.
PLAYBOOK_SECONDS = 600


def finish_playbook(proc: subprocess.Popen[str]) -> PlaybookRun:
    try:
        output, _ = proc.communicate(timeout=PLAYBOOK_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return PlaybookRun(proc.returncode, output)


def run_playbook(env: dict[str, str], inventory: Path, *args: str) -> PlaybookRun:
    return finish_playbook(start_playbook(env, inventory, *args))
