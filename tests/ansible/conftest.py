"""Session fixtures for the Ansible collection: an offline wheelhouse, and the collection on a private
collections path with isolated state; running playbooks is in ansible_helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ansible_helpers import BIN, COLLECTION
from wheelhouse import build_wheelhouse


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
