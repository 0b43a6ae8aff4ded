"""The global tier's vmalert unit: every argument escaped as systemd reads it, as in the other units."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
from ansible_helpers import COLLECTION
from rendering import role_defaults, systemd_argv

# Values an operator may set: a space, a quote, a specifier and a variable, all meant literally (an
# Alertmanager URL with a percent-encoded password, a rules directory under a path with a space).
HOSTILE_PREFIX = '/srv/gpu health/"100%zone"/$HOME'
HOSTILE_URLS = ["http://am:p%40ss$word@10.0.0.1:9093", 'http://10.0.0.2:9093/"x" y']


def render_unit(prefix: str, vmalert: str = "/usr/bin/vmalert") -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(COLLECTION / "roles" / "gpuhealth_global" /
                                                            "templates"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: f"# {text}"
    return env.get_template("gpuhealth-vmalert.service.j2").render({
        **role_defaults("gpuhealth_global"), "ansible_managed": "Ansible managed",
        "gpuhealth_global_vmalert": vmalert, "gpuhealth_global_alertmanager_urls": HOSTILE_URLS,
        "__gpuhealth_global_rules_dir": f"{prefix}/rules", "__gpuhealth_global_vm_url": "http://127.0.0.1:8428"})


def test_every_argument_reaches_vmalert_unchanged() -> None:
    """The values were pasted between quotes as they were: a quote ended the argument (and a space
    after it made a new one), % and $ were expanded by systemd."""
    argv = systemd_argv(render_unit(HOSTILE_PREFIX, vmalert=f"{HOSTILE_PREFIX}/vmalert"))
    assert argv[:2] == [f"{HOSTILE_PREFIX}/vmalert", f"-rule={HOSTILE_PREFIX}/rules/*.yml"]
    assert [a for a in argv if a.startswith("-notifier.url=")] == [f"-notifier.url={u}" for u in HOSTILE_URLS]
    assert argv[-1] == "-httpListenAddr=127.0.0.1:8880"
    assert all(a.startswith("-") for a in argv[1:]), argv


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is needed (scripts/bootstrap.sh installs it)"
    vmalert = tmp_path / "100%zone" / "vmalert"  # an unknown specifier (%z) if it were left unescaped
    vmalert.parent.mkdir()
    vmalert.symlink_to("/bin/true")
    unit = tmp_path / "gpuhealth-vmalert.service"
    unit.write_text(render_unit(str(tmp_path), vmalert=str(vmalert)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "specifier" not in result.stderr, result.stderr
