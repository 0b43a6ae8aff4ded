"""Render the roles' shared templates with plain jinja2, the way the demo does: the role defaults
that are plain values, plus the few values Ansible would compute, supplied by the caller."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import jinja2
import yaml
from ansible_helpers import COLLECTION


def role_defaults(role: str) -> dict[str, Any]:
    """A role's defaults without the ones Ansible computes (the renderer must supply those)."""
    defaults = yaml.safe_load((COLLECTION / "roles" / role / "defaults" / "main.yml").read_text())
    return {k: v for k, v in defaults.items() if not (isinstance(v, str) and "{{" in v)}


def render(role: str, template: str, variables: dict[str, Any], trim_blocks: bool = True) -> str:
    """Ansible renders with ``trim_blocks``; a renderer without it must produce the same YAML."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(COLLECTION / "roles" / role / "templates"),
        undefined=jinja2.StrictUndefined, trim_blocks=trim_blocks, keep_trailing_newline=True,
    )
    return env.get_template(template).render({**role_defaults(role), **variables})


def render_to(path: Path, role: str, template: str, variables: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(role, template, variables))
    return path


def systemd_argv(unit: str) -> list[str]:
    """ExecStart as systemd splits it: specifiers (%%) first, C-style quoting, then $$ (no variables)."""
    line = next(line for line in unit.replace("\\\n", " ").splitlines() if line.startswith("ExecStart="))
    command = line.removeprefix("ExecStart=")
    assert not re.search(r"(?<!%)%(?!%)", command.replace("%%", "")), "an unescaped specifier"
    assert not re.search(r"(?<!\$)\$(?!\$)", command.replace("$$", "")), "an unescaped variable"
    return [arg.replace("$$", "$") for arg in shlex.split(command.replace("%%", "%"))]
