"""The exporter's systemd unit: arguments escaped as systemd reads them, resource limits set."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
from ansible_helpers import COLLECTION
from rendering import role_defaults, systemd_argv

HOSTILE = ['--web.config.file=/etc/gpu health/"web".yml', "--kmsg-path=/var/log/%zkern$HOME\\.log",
           "--state-dir=/srv/100%"]


def render_unit(venv: Path, **variables: object) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(COLLECTION / "roles" / "gpuhealth_exporter" /
                                                            "templates"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: f"# {text}"
    values = {**role_defaults("gpuhealth_exporter"), "ansible_managed": "Ansible managed",
              "__gpuhealth_exporter_venv": str(venv),
              "__gpuhealth_exporter_config_file": "/etc/gpuhealth x.yml",
              "__gpuhealth_exporter_state_dir": "/var/lib/gpuhealth-exporter", **variables}
    return env.get_template("gpuhealth-exporter.service.j2").render(values)


def test_every_argument_survives_systemd_quoting(tmp_path: Path) -> None:
    unit = render_unit(tmp_path, gpuhealth_exporter_extra_args=HOSTILE)
    argv = systemd_argv(unit)
    assert argv[0] == f"{tmp_path}/bin/gpuhealth-exporter"
    assert argv[1:3] == ["--config", "/etc/gpuhealth x.yml"]
    assert argv[-3:] == HOSTILE


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    """``systemd-analyze verify`` rejects an unescaped unknown specifier such as %z."""
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is needed (scripts/bootstrap.sh installs it)"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "gpuhealth-exporter").symlink_to("/bin/true")
    unit = tmp_path / "gpuhealth-exporter.service"
    unit.write_text(render_unit(tmp_path, gpuhealth_exporter_extra_args=HOSTILE))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "specifier" not in result.stderr, result.stderr
    unit.write_text(unit.read_text().replace("%%zkern", "%zkern"))
    assert subprocess.run([analyze, "verify", str(unit)], capture_output=True, timeout=60).returncode != 0


def test_resource_limits_are_set(tmp_path: Path) -> None:
    unit = render_unit(tmp_path, gpuhealth_exporter_limit_nofile=4096)
    assert "LimitNOFILE=4096\n" in unit and "TasksMax=256\n" in unit and "MemoryMax=512M\n" in unit
