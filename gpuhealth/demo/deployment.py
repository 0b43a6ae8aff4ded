"""Render the stack's configuration from the Ansible roles' own templates.

The demo deploys exactly the files Ansible deploys (prometheus.yml, the file_sd targets, the
Alertmanager routing, the webhook config), rendered with plain jinja2 from the same templates and
the roles' defaults, so that a change to one is a change to both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "ansible" / "roles"


def role_defaults(role: str) -> dict[str, Any]:
    """A role's ``defaults/main.yml``; templated values are overridden by the caller where needed."""
    return yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text()) or {}


def render(role: str, template: str, variables: dict[str, Any]) -> str:
    """Render ``roles/<role>/templates/<template>`` with ``variables`` over the role's defaults."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROLES / role / "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    return env.get_template(template).render({**role_defaults(role), **variables})


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
