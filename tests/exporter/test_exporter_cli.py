"""Command line and configuration: flags, YAML, every problem listed at once, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml
from gpuhealth.exporter.config import ConfigError, build_settings, read_yaml
from gpuhealth.exporter.main import main
from gpuhealth.exporter.sim.scenario import ScenarioError, load_scenario, parse_scenario
from gpuhealth.exporter.web import check_password, hash_password

from gpuhealth.local.process import ManagedProcess, free_port, http_ok

EXPORTER = [sys.executable, "-m", "gpuhealth.exporter.main"]


def test_help_lists_collector_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for flag in ("--collector.gpu", "--no-collector.nfs", "--collector.xid", "--backend", "--sim-scenario",
                 "--kmsg-path", "--listen", "--config", "--state-dir", "--path.procfs"):
        assert flag in out


def test_bad_config_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({
        "backend": "cuda", "sampling_interval": -1, "kmsg_path": "/nonexistent/dir/kmsg",
        "listen": "nowhere", "colour": "blue", "log_level": 7,
        "collectors": {"gpu": True, "smart": True}, "web": {"tls_cert_file": "/nonexistent.pem",
                                                               "basic_auth_users": {"ops": "plaintext"}},
    }))
    assert main(["--config", str(config), "--path.procfs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    for needle in ("backend", "sampling_interval", "listen", "colour", "smart", "tls_cert_file",
                   "tls_key_file", "web.basic_auth_users.ops", "procfs", "log_level", "kmsg_path"):
        assert needle in err, needle
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) >= 11


def test_wrongly_typed_collectors_block_is_a_problem_not_a_crash() -> None:
    with pytest.raises(ConfigError, match="collectors: expected a mapping"):
        build_settings({"collectors": ["gpu"]}, {"collectors": {"nfs": False}}, ["gpu", "nfs"])


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "exporter.yml"
    config.write_text("backend: sim\nlisten: ':9000'\ncollectors: {nfs: false}\nsampling_window: 30\n")
    problems: list[str] = []
    settings = build_settings(read_yaml(config, problems), {"listen": "127.0.0.1:9999",
                                                            "collectors": {"host": False}},
                              ["gpu", "host", "nfs"], problems)
    assert settings.backend == "sim" and settings.listen == "127.0.0.1:9999"
    assert settings.collectors == {"nfs": False, "host": False}
    assert settings.sampling_window == 30.0 and settings.host_port == ("127.0.0.1", 9999)


def test_unreadable_yaml_is_one_clear_problem(tmp_path: Path) -> None:
    config = tmp_path / "exporter.yml"
    config.write_text("backend: [unclosed\n")
    with pytest.raises(ConfigError) as exc:
        build_settings(read_yaml(config, problems := []), {}, [], problems)
    assert "not valid YAML" in str(exc.value)


def test_bad_scenario_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "scenario.yml"
    scenario.write_text(yaml.safe_dump({"gpus": 4, "faults": [
        {"kind": "hbm_degradation"}, {"kind": "meteor_strike", "gpu": 1},
        {"kind": "nvlink_errors", "gpu": 9, "link": 40}, {"kind": "hbm_degradation", "gpu": 0, "xid": 31},
        {"kind": "sbe_burst", "gpu": 1, "start": -5, "precursor": 3}]}))
    assert main(["--backend", "sim", "--sim-scenario", str(scenario), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    for needle in ("needs 'gpu'", "meteor_strike", "GPU 9 does not exist", "link 40", "xid", "start",
                   "faults[4].precursor: unknown key for sbe_burst"):
        assert needle in err, needle
    assert "Traceback" not in err


def test_scenario_defaults_and_file_loading(tmp_path: Path) -> None:
    default = load_scenario(None)
    assert (default.gpus, default.nvlinks, default.faults) == (8, 18, ())
    assert "H100" in default.model
    path = tmp_path / "s.yml"
    path.write_text("faults:\n  - {kind: fell_off_bus, gpu: 7, start: 30}\n"
                    "  - {kind: hot_aisle, duration: 5}\n")
    faults = load_scenario(path).faults
    assert faults[0].gpus == (7,) and faults[0].start == 30 and not faults[0].is_noise
    assert faults[1].gpus == tuple(range(8)) and faults[1].is_noise
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yml")
    with pytest.raises(ScenarioError, match="mapping"):
        parse_scenario([1, 2])


def test_nvml_backend_without_a_driver_keeps_serving_nvml_up_0(tmp_path: Path) -> None:
    """Without libnvidia-ml (CI) the exporter stays up and says so; with a GPU it must serve the GPU."""
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        have_nvml = True
    except pynvml.NVMLError:
        have_nvml = False
    port = free_port()
    argv = [*EXPORTER, "--backend", "nvml", "--listen", f"127.0.0.1:{port}", "--no-kmsg"]
    with ManagedProcess("exporter", argv, tmp_path / "exporter.log") as proc:
        proc.start().wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    if have_nvml:
        assert 'backend="nvml"' in text and 'gpuhealth_gpu_up{gpu="0"} 1.0' in text
        return
    assert "gpuhealth_nvml_up 0.0" in text
    assert 'gpuhealth_nvml_init_errors_total{error="library_not_found"} 1.0' in text


def test_hash_password_round_trip() -> None:
    result = subprocess.run([*EXPORTER, "--hash-password"], input="s3cret\n", capture_output=True, text=True,
                            timeout=60)
    hashed = result.stdout.strip()
    assert result.returncode == 0 and hashed.startswith("pbkdf2_sha256$")
    assert check_password("s3cret", hashed) and not check_password("guess", hashed)
    assert hash_password("x") != hash_password("x")  # salted


@pytest.mark.parametrize(("key", "value"), [
    ("sampling_interval", float("nan")), ("sampling_interval", float("inf")), ("sampling_interval", True),
    ("sampling_interval", "1"), ("nvml_timeout", 0), ("gpus_expected", 2.9), ("gpus_expected", "8"),
    ("gpus_expected", True), ("gpus_expected", -1), ("gpus_expected", 65), ("gpus_expected", 10**400),
    ("no_kmsg", "false"), ("no_kmsg", 0),
    ("collectors", {"nfs": "false"}), ("procfs", 7),
])
def test_config_types_are_strict(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        build_settings({key: value}, {}, ["nfs"])


def test_exporter_toolkit_web_config_file(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("x")
    key.write_text("x")
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                                                         "min_version": "TLS13"},
                                   "basic_auth_users": {"prometheus": hashed}}))
    settings = build_settings({}, {"web_config_file": str(web)}, [])
    assert settings.tls_cert_file == cert and settings.tls_key_file == key
    assert settings.tls_min_version == "TLS13" and settings.basic_auth_users == {"prometheus": hashed}
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                                                         "client_auth_type": "RequireAnyClientCert",
                                                         "cipher_suites": ["x"]},
                                   "basic_auth_users": {"ops": "pbkdf2_sha256$1000$!!$x"}}))
    with pytest.raises(ConfigError) as problems:
        build_settings({}, {"web_config_file": str(web)}, [])
    text = "\n".join(problems.value.problems)
    for needle in ("client_auth_type", "cipher_suites", "basic_auth_users.ops"):
        assert needle in text, needle


def test_sim_profile_and_mig_only_with_the_simulator() -> None:
    with pytest.raises(ConfigError, match="sim_profile"):
        build_settings({}, {"sim_profile": "b200"}, [])
    with pytest.raises(ConfigError, match="sim_profile"):
        build_settings({}, {"backend": "sim", "sim_profile": "a100"}, [])
    assert build_settings({}, {"backend": "sim", "sim_profile": "b200", "sim_mig": True}, []).sim_mig


@pytest.mark.parametrize("user", ["a:b", "", "bob\n", "\x1b[2J"])
def test_a_user_name_that_can_never_log_in_is_refused_at_start(user: str) -> None:
    users = {user: hash_password("x", iterations=1000)}
    with pytest.raises(ConfigError, match="can never log in"):
        build_settings({"basic_auth_users": users}, {}, ["nfs"])


def test_a_wrongly_typed_user_mapping_is_reported_without_echoing_its_hashes() -> None:
    hashed = hash_password("x", iterations=1000)
    with pytest.raises(ConfigError) as caught:
        build_settings({"basic_auth_users": {123: hashed}}, {}, ["nfs"])
    assert "basic_auth_users" in str(caught.value) and hashed.split("$")[3] not in str(caught.value)


def test_a_config_file_that_is_not_utf8_is_one_clear_problem(tmp_path: Path) -> None:
    path = tmp_path / "exporter.yaml"
    path.write_bytes(b"backend: sim\nlisten: \"\xff\"\n")
    problems: list[str] = []
    assert read_yaml(path, problems) == {} and len(problems) == 1 and "not UTF-8 text" in problems[0]
    web = tmp_path / "web.yaml"
    web.write_bytes(b"basic_auth_users:\n  \xff: x\n")
    with pytest.raises(ConfigError, match="web_config_file"):
        build_settings({"web_config_file": str(web)}, {}, ["nfs"])


@pytest.mark.parametrize(("path", "message"), [("/dev/zero", "is a device"), ("/", "Is a directory")])
def test_a_config_path_that_is_no_file_is_one_clear_problem_not_a_hang(path: str, message: str) -> None:
    """``--config /dev/zero`` once read until memory ran out."""
    problems: list[str] = []
    assert read_yaml(Path(path), problems) == {} and len(problems) == 1
    assert problems[0].startswith(f"{path}: cannot read: ") and message in problems[0]


@pytest.mark.parametrize("key", ["kmsg_path", "state_dir", "sim_scenario", "procfs", "sysfs"])
def test_a_path_with_a_nul_byte_is_a_configuration_error(key: str) -> None:
    """``kmsg_path: "/dev/kmsg\\0x"`` passed validation and failed every sampling run with ValueError."""
    with pytest.raises(ConfigError, match="cannot hold a NUL byte"):
        build_settings({key: "/dev/kmsg\0x"}, {}, ["gpu"])
