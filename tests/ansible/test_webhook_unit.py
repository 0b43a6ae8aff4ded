"""The webhook's systemd unit: paths escaped as systemd reads them, as in the exporter's unit."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import jinja2
from ansible_helpers import COLLECTION
from rendering import role_defaults, systemd_argv

# a prefix an operator may choose: a space, a quote, a specifier and a variable, all meant literally
HOSTILE_PREFIX = '/srv/gpu health/"100%"/$HOME'


def render_unit(prefix: str) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(COLLECTION / "roles" / "gpuhealth_webhook" /
                                                            "templates"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: f"# {text}"
    return env.get_template("gpuhealth-webhook.service.j2").render({
        **role_defaults("gpuhealth_webhook"), "ansible_managed": "Ansible managed",
        "__gpuhealth_webhook_venv": f"{prefix}/venv",
        "__gpuhealth_webhook_config_file": f"{prefix}/webhook.yml",
        "__gpuhealth_webhook_state_dir": f"{prefix}/state"})


def test_paths_with_quotes_specifiers_and_variables_reach_the_webhook_unchanged() -> None:
    """The paths were pasted between quotes as they were: a quote ended the argument and % or $ were
    expanded by systemd."""
    unit = render_unit(HOSTILE_PREFIX)
    assert systemd_argv(unit) == [f"{HOSTILE_PREFIX}/venv/bin/gpuhealth-webhook", "--config",
                                  f"{HOSTILE_PREFIX}/webhook.yml"]
    line = next(line for line in unit.splitlines() if line.startswith("ReadWritePaths="))
    value = line.removeprefix("ReadWritePaths=")
    assert "%" not in value.replace("%%", "") and "$" not in value.replace("$$", "")
    assert shlex.split(value.replace("%%", "%").replace("$$", "$")) == [f"{HOSTILE_PREFIX}/state"]


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is needed (scripts/bootstrap.sh installs it)"
    prefix = tmp_path / "100%zone"  # an unknown specifier (%z) if it were left unescaped
    (prefix / "venv" / "bin").mkdir(parents=True)
    (prefix / "venv" / "bin" / "gpuhealth-webhook").symlink_to("/bin/true")
    unit = tmp_path / "gpuhealth-webhook.service"
    unit.write_text(render_unit(str(prefix)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "specifier" not in result.stderr, result.stderr
