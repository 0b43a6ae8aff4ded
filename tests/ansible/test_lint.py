"""ansible-lint's production profile passes on the whole collection, offline."""

from __future__ import annotations

import subprocess

from ansible_helpers import BIN, COLLECTION


def test_ansible_lint_production_profile(ansible_env):
    result = subprocess.run([str(BIN / "ansible-lint"), "--offline", "--profile", "production", "--nocolor"],
                            cwd=COLLECTION, env=ansible_env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Profile 'production' was required, and it passed" in output
