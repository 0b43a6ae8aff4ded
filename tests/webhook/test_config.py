"""Configuration: the example starts as it is, every problem is listed at once, flags override."""

from __future__ import annotations

import json
import socket
import sqlite3
import ssl
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from fake_kube import make_pki
from gpuhealth.webhook.config import ConfigError, load_config, parse_config
from gpuhealth.webhook.main import main
from gpuhealth.webhook.stores import describe
from webhook_helpers import alert, notification

from gpuhealth.local.process import ManagedProcess, free_port, http_ok

EXAMPLE = Path(__file__).parents[2] / "webhook" / "config.example.yaml"


def test_example_config_is_valid_and_safe():
    config = load_config(EXAMPLE)
    assert config.backend["type"] == "slurm"
    assert not config.auth.disabled and config.token_path == config.state_dir / "token"
    g = config.guardrails
    assert (g.breaker_max_nodes, g.breaker_max_fraction, g.require_approval) == (2, 0.05, ("replace",))
    assert config.undrain.mode == "auto" and config.listen_port == 9836


def test_every_problem_is_listed_at_once(tmp_path):
    bad = {
        "listen": "nowhere", "dry_run": "yes", "surprise": 1,
        "auth": {"basic_auth": {"username": "am"}, "operator": {"colour": "red"}},
        "backend": {"type": "simulated", "nodes": []},
        "policy": {"rules": [{"match": {"alertname": "("}, "action": "explode"}]},
        "guardrails": {"breaker_max_fraction": 2, "require_approval": ["reboot"], "rate_limit_actions": 0,
                       "requeue_breaker_max_nodes": 0},
        "connection_idle_timeout_seconds": -1, "connection_limit": 0,
        "undrain": {"mode": "sometimes"},
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    text = str(caught.value)
    for needle in ("listen: 'nowhere'", "dry_run: expected a boolean", "surprise: unknown key",
                   "auth.basic_auth.password_file: required", "policy.rules[0].action",
                   "policy.rules[0].match.alertname",
                   "breaker_max_fraction", "'reboot' is not one of", "rate_limit_actions",
                   "undrain.mode", "auth.operator.colour: unknown key",
                   "auth.operator: needs token_file, basic_auth or both", "requeue_breaker_max_nodes",
                   "connection_idle_timeout_seconds", "connection_limit: expected an integer > 0"):
        assert needle in text, needle
    assert len(caught.value.errors) == 15


def test_backend_problems_are_listed_with_the_rest(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": [], "color": "red"},
                                    "undrain": {"mode": "never"}}))
    assert main(["--config", str(path), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "backend.nodes" in err and "color" in err and "undrain.mode" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"), ("backend: [", "not valid YAML"), ("backend: {type: pbs}", "unknown backend type"),
    ("- just a list", "must be a mapping"), (b"state_dir: /tmp/\xff\n", "not UTF-8 text"),
    ("/dev/zero", "is a device"),  # once read until memory ran out
])
def test_unusable_files_give_one_clear_line(tmp_path, capsys, content, message):
    path = tmp_path / "config.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None and content.startswith("/dev/"):
        path = Path(content)
    elif content is not None:
        path.write_text(content)
    assert main(["--config", str(path), "--check-config"]) == 2
    assert message in capsys.readouterr().err


def test_missing_token_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": ["n1"]},
                                    "auth": {"token_file": "absent.token"}}))
    assert main(["--config", str(path), "--state-dir", str(tmp_path)]) == 2
    assert "absent.token: cannot read" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": ["n1"]},
                                    "auth": {"token_file": "/dev/zero"}}))
    assert main(["--config", str(path), "--state-dir", str(tmp_path)]) == 2
    assert "/dev/zero: cannot read: is a device" in capsys.readouterr().err


def test_unusable_state_dir_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": ["n1"]}}))
    (tmp_path / "occupied").write_text("a file where the state directory should be")
    assert main(["--config", str(path), "--state-dir", str(tmp_path / "occupied" / "state")]) == 2
    err = capsys.readouterr().err
    assert "occupied" in err and "Traceback" not in err


def test_a_listen_address_that_cannot_be_served_is_a_clear_error(tmp_path, capsys):
    """A port in use (or a host that does not resolve) ended in a traceback; an unbalanced bracket or
    a host with colons that is no IPv6 address passed the check and failed the same way."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": ["n1"]}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--config", str(path), "--state-dir", str(tmp_path), "--listen", f"127.0.0.1:{port}"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}: " in err and "Traceback" not in err
    for bad in ("[::1:9836", "gpu:01:9836", "[]:9836", "127.0.0.1:\u0663"):
        assert main(["--config", str(path), "--listen", bad, "--check-config"]) == 2, bad
        assert "is not HOST:PORT" in capsys.readouterr().err
    for good in (":::9836", "[::1]:9836", "gpu-a001:9836"):
        assert main(["--config", str(path), "--listen", good, "--check-config"]) == 0, good


def test_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--listen", "--dry-run", "--token-file", "--state-dir"):
        assert flag in out


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    config = parse_config({"backend": {"type": "simulated", "nodes": ["n1"]}, "state_dir": "state",
                           "auth": {"token_file": "t"}}, tmp_path)
    assert config.state_dir == tmp_path / "state" and config.auth.token_file == tmp_path / "t"


@pytest.mark.slow
def test_example_config_starts_as_it_is_with_dry_run(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "gpuhealth.webhook.main", "--config", str(EXAMPLE), "--dry-run",
            "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state")]
    with ManagedProcess("webhook", argv, tmp_path / "webhook.log") as proc:
        proc.start()
        proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        token = (tmp_path / "state" / "token").read_text().strip()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/alerts", data=json.dumps(notification(alert("gpu01"))).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.load(resp)["new_actions"] == [1]

        def dry_run_done() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/actions", timeout=5) as resp:
                actions = json.load(resp)["actions"]
            return bool(actions) and actions[0]["outcome"] == "dry_run"

        proc.wait_ready(dry_run_done, timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        series = 'gpuhealth_webhook_actions_total{action="drain",outcome="dry_run",reason="dry_run"}'
        assert f"{series} 1.0" in metrics
        assert "_created" not in metrics
    assert (tmp_path / "state" / "token").stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_tls_with_client_certificates(tmp_path):
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    (tmp_path / "token").write_text("tls-token")
    config = tmp_path / "webhook.yaml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "state_dir": "state", "auth": {"token_file": "token"},
        "backend": {"type": "simulated", "nodes": ["gpu01"]},
        "tls": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                "client_ca_file": str(pki.ca)}}))
    client = ssl.create_default_context(cafile=str(pki.ca))
    client.load_cert_chain(pki.client_cert, pki.client_key)
    anonymous = ssl.create_default_context(cafile=str(pki.ca))
    url = f"https://127.0.0.1:{port}"

    def post(context: ssl.SSLContext) -> int:
        body = json.dumps(notification(alert("gpu01"))).encode()
        request = urllib.request.Request(f"{url}/alerts", data=body,
                                         headers={"Authorization": "Bearer tls-token",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return resp.status

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2, context=client) as resp:
                return resp.status == 200
        except OSError:
            return False

    argv = [sys.executable, "-m", "gpuhealth.webhook.main", "--config", str(config)]
    with ManagedProcess("webhook", argv, tmp_path / "webhook.log") as proc:
        proc.start()
        proc.wait_ready(ready, timeout=30)
        assert post(client) == 200
        with pytest.raises(OSError):  # the handshake fails without a client certificate
            post(anonymous)
        assert not http_ok(f"http://127.0.0.1:{port}/healthz")


def test_an_unreachable_or_newer_journal_stops_the_start_with_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    url = f"postgresql://gpuhealth:secret@127.0.0.1:{free_port()}/gpuhealth"
    path.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": ["n1"]},
                                    "journal": {"url": url}}))
    assert main(["--config", str(path), "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "gpuhealth:***@127.0.0.1" in err and "secret" not in err and "Traceback" not in err
    sqlite_config = tmp_path / "sqlite.yaml"
    sqlite_config.write_text(yaml.safe_dump({"backend": {"type": "simulated", "nodes": ["n1"]}}))
    (tmp_path / "state").mkdir()
    with sqlite3.connect(tmp_path / "state" / "journal.sqlite3") as db:
        db.execute("PRAGMA user_version = 999")
    assert main(["--config", str(sqlite_config), "--state-dir", str(tmp_path / "state")]) == 2
    assert "schema version 999, newer than this webhook's" in capsys.readouterr().err


@pytest.mark.parametrize(("health_check", "problem"), [
    (["ssh", "--", "{node}", "validate {reason}"], "{reason} is free text and 'ssh' hands it to a shell"),
    (["check", "{gpu}"], "unknown placeholder(s) {gpu}"),
    ("ssh {node} gpuhealth-validate", "a non-empty list of strings (argv, no shell)"),
    (["check", "{node!r}"], "!r is not a conversion"),
])
def test_undrain_health_check_is_an_argv_template_with_node_only(health_check, problem):
    with pytest.raises(ConfigError) as caught:
        parse_config({"backend": {"type": "simulated"}, "undrain": {"health_check": health_check}})
    assert any(e.startswith("undrain.health_check: ") and problem in e for e in caught.value.errors), \
        caught.value.errors


def test_undrain_health_check_defaults_to_validation_over_ssh_and_can_be_turned_off_or_replaced():
    def check(**undrain):
        return parse_config({"backend": {"type": "simulated"}, "undrain": undrain}).undrain.health_check
    assert check() == ("ssh", "-o", "BatchMode=yes", "--", "{node}", "gpuhealth-validate")
    assert check(health_check=[]) == ()
    assert check(health_check=["pdsh", "-w", "{node}", "gpuhealth-validate --gpus-expected 8"]) == (
        "pdsh", "-w", "{node}", "gpuhealth-validate --gpus-expected 8")


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://gpuhealth:p@ss/w?rd@db.example:5432/gpuhealth", "postgresql://gpuhealth:***@db.example:5432/gpuhealth"),
    ("postgresql://db.example/gpuhealth?sslmode=require&password=secret", "postgresql://db.example/gpuhealth?***"),
    ("postgresql://db.example/gpuhealth?application_name=a@b&password=secret", "postgresql://***@***"),
    ("postgresql://gpu%40health:secret@h1:5432,h2:5433/gpuhealth", "postgresql://***:***@h1:5432,h2:5433/gpuhealth"),
])
def test_a_journal_url_is_logged_without_its_password_wherever_the_password_is(url, shown):
    """The password was cut at its first "@" or "/" (the rest shown) and ?password= was shown whole."""
    config = parse_config({"backend": {"type": "simulated", "nodes": ["n1"]}, "journal": {"url": url}})
    assert describe(config) == shown


@pytest.mark.parametrize("url", ["postgresql://gpuhealth:se cret@h/db", "mysql://gpuhealth:secret@h/db"])
def test_a_refused_journal_url_is_not_echoed(url):
    with pytest.raises(ConfigError) as refused:
        parse_config({"backend": {"type": "simulated", "nodes": ["n1"]}, "journal": {"url": url}})
    assert "journal.url" in str(refused.value) and "secret" not in str(refused.value)


@pytest.mark.parametrize("window", [-0.001, 1.5, float("nan"), "soon"])
def test_a_commit_window_out_of_range_is_refused(window):
    with pytest.raises(ConfigError, match=r"journal\.commit_window_seconds"):
        parse_config({"backend": {"type": "simulated", "nodes": ["n1"]},
                      "journal": {"commit_window_seconds": window}})


def test_the_commit_window_is_off_by_default_and_can_be_set():
    base = {"backend": {"type": "simulated", "nodes": ["n1"]}}
    assert parse_config(base).journal.commit_window_seconds == 0
    windowed = parse_config(base | {"journal": {"commit_window_seconds": 0.005}})
    assert windowed.journal.commit_window_seconds == 0.005
