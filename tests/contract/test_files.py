"""Reading a file an operator names: bounded, regular files and pipes only, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from gpuhealth.contract.files import parse_yaml, read_text
from gpuhealth.exporter.config import read_yaml
from gpuhealth.webhook.config import ConfigError, load_config


def test_a_small_file_is_read_and_a_fifo_without_a_writer_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / "ok.yaml").write_text("backend: sim\n")
    assert read_text(tmp_path / "ok.yaml") == "backend: sim\n"
    os.mkfifo(tmp_path / "fifo")
    assert read_text(tmp_path / "fifo") == ""  # nobody writes: empty at once, not a hang in open()


@pytest.mark.parametrize(("name", "message"), [
    ("/dev/zero", "is a device or socket, not a file"),
    ("dir", "Is a directory"),
    ("big", "larger than 1024 bytes"),
    ("latin1", "not UTF-8 text (byte 3)"),
])
def test_what_is_not_a_small_text_file_is_a_clear_oserror(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_text("x" * 1025)
    (tmp_path / "latin1").write_bytes(b"a: \xff\n")
    path = Path(name) if name.startswith("/") else tmp_path / name
    with pytest.raises(OSError) as caught:
        read_text(path, limit=1024)
    assert message in (caught.value.strerror or "")


def test_a_key_given_twice_is_refused_and_nothing_else_changes() -> None:
    """YAML keeps the last of two equal keys silently: a second ``token_file:`` pasted below the first
    quietly replaced it."""
    with pytest.raises(yaml.YAMLError, match="key 'token_file' is given twice"):
        parse_yaml("auth:\n  token_file: a\n  token_file: b\n")
    base = "defaults: &d {a: 1}\nnode: {<<: *d, a: 2}\n"  # a merge key that overrides stays allowed
    assert parse_yaml(base) == yaml.safe_load(base)
    with pytest.raises(yaml.YAMLError):
        parse_yaml('x: !!python/object/apply:os.system ["true"]')


def test_the_webhook_and_exporter_configurations_refuse_a_key_given_twice(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("backend: {type: simulated, nodes: [n1]}\ndry_run: false\ndry_run: true\n")
    with pytest.raises(ConfigError, match="'dry_run' is given twice"):
        load_config(path)
    path.write_text("gpus_expected: 8\ngpus_expected: 4\n")
    problems: list[str] = []
    assert read_yaml(path, problems) == {} and "'gpus_expected' is given twice" in problems[0]


BOMB = "".join(f"{level}: &{level} [{', '.join([f'*{prev}'] * 9)}]\n"
               for prev, level in zip("abcdefgh", "bcdefghi", strict=True))


@pytest.mark.parametrize("document", [
    'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BOMB,  # 387 million nodes in 400 bytes
    "a: &a [x]\n" + BOMB + "j: &j [*i, *i, *i, *i, *i, *i, *i, *i, *i]\n",
])
def test_an_alias_bomb_is_refused_before_it_is_walked(document: str) -> None:
    with pytest.raises(yaml.YAMLError, match="aliases expand past"):
        parse_yaml(document)


def test_aliases_within_the_bound_nesting_and_recursive_aliases_still_load() -> None:
    assert parse_yaml("base: &b {x: 1}\nuse: *b\nmerged:\n  <<: *b\n  y: 2\n") == {
        "base": {"x": 1}, "use": {"x": 1}, "merged": {"x": 1, "y": 2}}
    assert parse_yaml('a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BOMB[:BOMB.index("f:")])["e"]
    recursive = parse_yaml("&r [1, *r]\n")
    assert recursive[0] == 1 and recursive[1] is recursive
    depth = 200
    nested = parse_yaml("[" * depth + "]" * depth)
    for _ in range(depth - 1):
        nested = nested[0]
    assert nested == []


def test_nesting_too_deep_for_pyyaml_is_a_yaml_error_not_a_recursion_traceback() -> None:
    with pytest.raises(yaml.YAMLError, match="nested too deeply"):
        parse_yaml("[" * 10_000 + "]" * 10_000)
