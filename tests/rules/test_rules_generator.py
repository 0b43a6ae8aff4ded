"""The generator: committed files current, every knob used, overlays, clear errors, valid output."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpuhealth.contract.duration import parse_duration
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all
from rules_promtool import GENERATED, SOURCES, Fleet, alert, run_promtool

from gpuhealth.cli import main

RULES = GENERATED.parent
DEMO = RULES / "overlays" / "demo.yaml"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install the Debian packages from scripts/bootstrap.sh")
    return path


def test_committed_files_are_current(capsys):
    assert main(["rules", "generate", "--check"]) == 0, capsys.readouterr().err


def test_check_reports_stale_and_extra_files(tmp_path, capsys):
    assert main(["rules", "generate", "--out", str(tmp_path)]) == 0
    assert main(["rules", "generate", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "gpuhealth" / "xid.yml").write_text("groups: []\n")
    (tmp_path / "dcgm" / "old-group.yml").write_text("groups: []\n")
    capsys.readouterr()
    assert main(["rules", "generate", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "gpuhealth/xid.yml" in err and "dcgm/old-group.yml" in err and "dcgm/xid.yml" not in err
    assert main(["rules", "generate", "--out", str(tmp_path)]) == 0   # regenerating removes the leftover
    assert not (tmp_path / "dcgm" / "old-group.yml").exists()


def test_output_is_deterministic():
    assert render_all(catalogue.load()) == render_all(catalogue.load())


@pytest.mark.parametrize("source", SOURCES)
def test_promtool_check_rules(source):
    files = sorted((GENERATED / source).glob("*.yml"))
    assert [f.stem for f in files] == sorted(["xid", "definitive", "fabric", "evidence", "fusion", "lemon",
                                              "fleet", "storage", "meta"])
    result = subprocess.run([_tool("promtool"), "check", "rules", *map(str, files)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_carries_the_contract():
    for source in SOURCES:
        for path in (GENERATED / source).glob("*.yml"):
            groups = yaml.safe_load(path.read_text())["groups"]   # the dcgm source has no fabric group
            for rule in (rule for group in groups for rule in group["rules"]):
                if "alert" not in rule:
                    assert rule["record"].startswith("gpuhealth:")
                    continue
                assert rule["alert"].startswith("GPUHealth")
                assert rule["labels"]["severity"] in ("critical", "warning", "info")
                assert rule["labels"]["action"] in catalogue.ACTIONS
                assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}


def test_runbook_has_a_section_per_alert():
    runbook = (RULES / "runbooks.md").read_text()
    headings = {line[3:].strip() for line in runbook.splitlines() if line.startswith("## ")}
    assert headings == set(catalogue.load().alerts)


def test_alertmanager_config_routes_by_action_and_inhibits(tmp_path):
    config = RULES / "alertmanager.yml"
    amtool = _tool("amtool")
    result = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr

    def receiver(*labels: str) -> str:
        out = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config}", *labels],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip()

    for action in ("restart_job", "drain", "drain_reset_gpu", "drain_reboot", "replace"):
        assert receiver("node=n1", f"action={action}") == "gpuhealth-webhook"
    assert receiver("node=n1", "action=none") == "gpuhealth-notify"
    data = yaml.safe_load(config.read_text())
    assert data["route"]["group_by"] == ["cluster", "node"]
    (inhibit,) = data["inhibit_rules"]
    assert inhibit["equal"] == ["cluster", "node"]
    assert "GPUHealthGpuFailureRisk" in inhibit["target_matchers"][0]
    assert "GPUHealthXidRebootNode" in inhibit["source_matchers"][0]
    webhook = data["receivers"][1]["webhook_configs"][0]
    assert webhook["url"] == "http://127.0.0.1:9836/alerts"
    assert webhook["http_config"]["authorization"]["credentials_file"] == "/etc/gpuhealth/webhook.token"


def test_catalogue_errors_are_all_listed_without_traceback(tmp_path, capsys):
    overlay = tmp_path / "bad.yaml"
    overlay.write_text(yaml.safe_dump({
        "defaults": {
            "scrape_interval": "2m",                              # makes 5m windows too short
            "evidence": {"nvlink_errors": {"low": 2, "high": 1, "windw": "5m"},
                         "pcie_replay": {"step": "7m"}},          # 1h is not a multiple of 7m
            "fusion": {"weights": {"nvlink_errors": 0.9},         # alone above the threshold
                       "causes": {"nvlink": ["nvlink_errors", "pcie_replay"], "firmware": []}},
            "xid": {"overrides": {"drain_reboot": [167, 168], "reboot_now": [13]},
                    "buckets": {"RESET_GPU": "reboot"}},
            "for": {"GPUHealthExporterDown": "soon"},
            "gpu_shards": 4,
            "definitive": {"ecc_storm": {"fleet_quantile": 1.5}},
        },
        "alerts": {"GPUHealthLemonNode": {"action": "shoot"}},
    }))
    assert main(["rules", "generate", "--catalogue", str(overlay), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for expected in (
        "defaults.evidence.nvlink_errors.windw: unknown key",
        "defaults.evidence.nvlink_errors: low (2) must be a number below high (1)",
        "defaults.storage.window: 5m holds fewer than 4 samples at scrape_interval 2m; use at least 480s",
        "defaults.evidence.pcie_replay: window 1h must be a multiple (> 1) of step 7m",
        "defaults.fusion.weights.nvlink_errors: 0.9 >= fusion.threshold 0.6",
        "defaults.fusion.causes.nvlink: pcie_replay is also in cause pcie",
        "defaults.fusion.causes: signal nvml_latency is in no cause",
        "defaults.xid.overrides.drain_reboot: XID 168 is also in class drain_reset_gpu",
        "defaults.xid.overrides.reboot_now: unknown key",
        "defaults.xid.buckets.RESET_GPU: 'reboot' is not one of restart_job, drain, drain_reset_gpu",
        "defaults.for.GPUHealthExporterDown: 'soon' is not a duration (whole numbers with units",
        "alerts.GPUHealthLemonNode.action: 'shoot' is not one of none, restart_job",
        "defaults.gpu_shards: 4 is not one of 1, 2, 5, 10",
        "defaults.definitive.ecc_storm.fleet_quantile: expected a number < 1, got 1.5",
    ):
        assert expected in err, f"missing {expected!r} in:\n{err}"
    assert not (tmp_path / "out").exists()


def test_unreadable_overlay_is_a_clear_error(tmp_path, capsys):
    assert main(["rules", "generate", "--catalogue", str(tmp_path / "missing.yaml"), "--check"]) == 2
    assert "cannot read" in capsys.readouterr().err


def _leaves(node: Any, path: tuple[str, ...] = ()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path, node


@pytest.mark.parametrize("shards", [1, 2, 5, 10])
def test_gpu_shards_cover_every_gpu_once(shards):
    """The peer class is split into `gpu_shards` groups by GPU index: any index, on nodes of any size,
    is in exactly one of them, or a GPU would have no peers or two peer classes."""
    rendered = yaml.safe_load(render_all(catalogue.resolve({"defaults": {"gpu_shards": shards}}))
                              ["gpuhealth/evidence.yml"])
    peer_rules = [rule for group in rendered["groups"] for rule in group["rules"]
                  if rule.get("record") == "gpuhealth:gpu_peer_class:info"]
    peer_groups = {g["name"] for g in rendered["groups"] if g["name"].startswith("gpuhealth-peers")}
    assert len(peer_groups) == len(peer_rules) == shards
    matchers = [re.search(r'gpu=~"([^"]+)"', rule["expr"]) for rule in peer_rules]
    patterns = [re.compile(m.group(1) if m else ".*") for m in matchers]
    for index in range(128):
        assert sum(bool(p.fullmatch(str(index))) for p in patterns) == 1, index


@pytest.mark.parametrize("shards", [1, 2, 5, 10])
def test_group_names_are_unique_in_every_file_at_any_shard_count(shards):
    """Prometheus refuses a rule file that names a group twice, so a split into one shard (no suffix)
    must not meet a group of the same name."""
    overlay = {"defaults": {"gpu_shards": shards, "fabric": {"hca_shards": shards}}}
    for path, text in render_all(catalogue.resolve(overlay)).items():
        names = [group["name"] for group in (yaml.safe_load(text) or {}).get("groups", [])]
        assert sorted(set(names)) == sorted(names), path


@pytest.mark.parametrize("shards", [1, 2, 5, 10])
def test_hca_shards_cover_every_port_once(shards):
    """The rate alert and the ports' link-error evidence are split into `hca_shards` groups by HCA name:
    any name, with a last digit or none, is in exactly one of each, or a port would be read twice or
    never."""
    rendered = render_all(catalogue.resolve({"defaults": {"fabric": {"hca_shards": shards}}}))
    groups = [group for name in ("gpuhealth/fabric.yml", "gpuhealth/evidence.yml")
              for group in yaml.safe_load(rendered[name])["groups"]]
    for name, first_read in (("GPUHealthNicRateDegraded", "gpuhealth_nic_port_rate_bytes_per_second"),
                             ("gpuhealth:nic_port_evidence:link_errors", "gpuhealth_nic_port_errors_total")):
        rules = [(group["name"], rule) for group in groups for rule in group["rules"]
                 if name in (rule.get("alert"), rule.get("record"))]
        assert len({group for group, _ in rules}) == len(rules) == shards
        selectors = [re.search(first_read + r"\{([^}]*)\}", rule["expr"]) for _, rule in rules]
        matchers = [re.search(r'device(=~|!~)"([^"]+)"', s.group(1)) if s else None for s in selectors]
        for device in [f"mlx5_{index}" for index in range(24)] + ["mlx5_bond_0", "ibp12s0f1", "rxe_eth"]:
            chosen = sum(1 for m in matchers if m is None
                         or (re.fullmatch(m.group(2), device) is not None) == (m.group(1) == "=~"))
            assert chosen == 1, (name, device)


@pytest.mark.parametrize("shards", [1, 2, 5, 10])
@pytest.mark.parametrize(("file", "name"), [
    ("evidence.yml", "gpuhealth:gpu_temperature_celsius:peer_deviation_drift"),
    ("evidence.yml", "gpuhealth:gpu_evidence:thermal_slowdown"),
    ("evidence.yml", "gpuhealth:gpu_evidence:remapped_rows_growth"),
    ("evidence.yml", "gpuhealth:gpu_evidence:pcie_replay"),
    ("evidence.yml", "gpuhealth:gpu_evidence:pcie_link_downgrade"),
    ("evidence.yml", "gpuhealth:gpu_evidence:pcie_aer_errors"),
    ("evidence.yml", "gpuhealth:gpu_set_node_evidence:zero"),
    ("definitive.yml", "GPUHealthPcieReplayRate"),
    ("evidence.yml", "gpuhealth:gpu_temperature_celsius:peer_deviation_daily"),
    ("evidence.yml", "gpuhealth:gpu_temperature_celsius:peer_deviation_daily_rise"),
    ("definitive.yml", "gpuhealth:gpu_temperature_celsius:peer_deviation_moved"),
    ("definitive.yml", "GPUHealthGpuCoolingFailing"),
])
def test_rules_split_by_gpu_index_cover_every_gpu_once(shards, file, name):
    """A rule split into `gpu_shards` groups by GPU index reads each GPU in exactly one of them (in
    every selector of the rule), so no GPU loses its record or alert, or gets two. The temperature
    drift is listed before the baseline that reads it (promtool evaluates groups in order)."""
    groups = yaml.safe_load(render_all(catalogue.resolve({"defaults": {"gpu_shards": shards}}))
                            [f"gpuhealth/{file}"])["groups"]
    rules = [rule for group in groups for rule in group["rules"]
             if name in (rule.get("record"), rule.get("alert"))]
    assert len(rules) == shards
    matchers = [set(re.findall(r'gpu=~"([^"]+)"', rule["expr"])) for rule in rules]
    assert all(len(m) == (shards > 1) for m in matchers)
    patterns = [re.compile(next(iter(m)) if m else ".*") for m in matchers]
    for index in range(128):
        assert sum(bool(p.fullmatch(str(index))) for p in patterns) == 1, index
    if name.endswith("peer_deviation_drift"):
        order = [g["name"] for g in groups]
        drift = [i for i, g in enumerate(groups) if any(r.get("record") == name for r in g["rules"])]
        assert max(drift) < order.index("gpuhealth-evidence-temperature-baseline")


def _changed(value: Any, key: str) -> Any:
    """A different, still valid value for a knob."""
    if isinstance(value, list):
        if not value:
            return [1]
        return value[:-1] if len(value) > 1 else ([value[0] + 1] if isinstance(value[0], int) else [])
    if key in ("gpu_shards", "hca_shards"):
        return 2 if value != 2 else 5
    if isinstance(value, int):
        return value - 1 if key == "low" else value + 1
    if isinstance(value, float):
        if key == "threshold":
            return round((1 + value) / 2, 3)   # lowering it would let one weight alone reach it
        return round(value * 0.7 + 0.0001, 5) if value < 1 else value + 0.5
    if not value:
        return 'cluster="a"'
    try:
        seconds = parse_duration(value)
    except ValueError:
        return value + ("|x" if "|" in value else "/x")
    return f"{2 * seconds}s" if seconds else "1m"


def _overlay(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    overlay: dict[str, Any] = value
    for key in reversed(path):
        overlay = {key: overlay}
    return overlay


@pytest.mark.timeout(1200)  # renders every rule once per knob (hundreds of knobs)
def test_every_knob_takes_effect():
    """Changing any single value of `defaults` changes the rendered rules or routing: no knob is
    ignored and no window, threshold or weight is hard-coded in a template."""
    builtin = yaml.safe_load(catalogue.BUILTIN.read_text())
    baseline = render_all(catalogue.load())
    ignored, invalid = [], []
    for path, value in _leaves(builtin["defaults"], ("defaults",)):
        if path == ("defaults", "scrape_interval"):
            continue   # renders nothing: it bounds the windows (test_catalogue_errors_are_all_listed)
        new = _changed(value, path[-1])
        if path[-1] in ("gpuhealth_job", "dcgm_job", "node_exporter_job"):
            new = 'job="renamed"'
        if path[-1] == "identity_labels":
            new = ["site", *value]
        if path[-2] == "buckets":
            new = "drain" if value != "drain" else "none"
        if path[-2] == "overrides":   # move one more XID: 13 out of restart_job, or 1 (unused) into a class
            new = [*value, 13 if path[-1] == "none" else 1]
        overlay = _overlay(path, new)
        if path[-2] == "causes":   # move the cause's first signal into another cause
            causes = builtin["defaults"]["fusion"]["causes"]
            other = next(c for c in causes if c != path[-1])
            overlay = _overlay(path[:-1], {path[-1]: value[1:], other: [*causes[other], value[0]]})
        try:
            rendered = render_all(catalogue.resolve(overlay))
        except catalogue.CatalogueError as exc:
            invalid.append(f"{'.'.join(path)}={new!r}: {exc.errors}")
            continue
        if rendered == baseline:
            ignored.append(".".join(path))
    assert not invalid, invalid
    assert not ignored, f"knobs with no effect on the output: {ignored}"


def test_overlay_merges_over_the_builtin_catalogue():
    builtin = catalogue.load()
    demo = catalogue.load(DEMO)
    assert demo.defaults["scrape_interval"] == "5s"
    assert demo.defaults["evidence"]["nvlink_errors"] == {**builtin.defaults["evidence"]["nvlink_errors"],
                                                          "window": "30s"}
    assert demo.defaults["fusion"] == builtin.defaults["fusion"]
    unchanged = copy.deepcopy(builtin.alerts)
    assert demo.alerts == unchanged


def test_demo_overlay_fires_within_two_minutes(tmp_path):
    """The demo's short windows: a collapse plus NVLink errors played for two minutes raises the risk."""
    out = tmp_path / "rules"
    assert main(["rules", "generate", "--catalogue", str(DEMO), "--out", str(out),
                 "--source", "gpuhealth"]) == 0
    steps = 36   # 3 minutes of 5 s samples
    fleet = Fleet("gpuhealth")
    for node in ("n1", "n2", "n3"):
        collapsed = node == "n2"
        for gpu in range(8):
            fleet.gpu(node, gpu, steps)
        fleet.add("interrupts", node, None, (0, (1500 if collapsed else 10_000) * 5, steps))
        fleet.add("procs_running", node, None, (2 if collapsed else 40, 0, steps))
    fleet.add("nvlink_crc", "n2", 3, (0, 0, 11), (0, 5, steps - 12))    # errors from the first minute
    risk = alert("GPUHealthGpuFailureRisk",
                 {"alertname": "GPUHealthGpuFailureRisk", "node": "n2", "gpu": "3"},
                 "GPU 3 on n2 is likely to fail (risk 0.75)",
                 "Several precursor signals of GPU 3 on n2 together put its failure risk at 0.75. Top "
                 "contributions: nvlink_errors=0.45, interrupt_collapse=0.30, procs_running_collapse=0.20.",
                 "warning", "checkpoint_drain")
    checks = [{"eval_time": "1m", "alertname": "GPUHealthGpuFailureRisk", "exp_alerts": []},
              {"eval_time": "2m", "alertname": "GPUHealthGpuFailureRisk", "exp_alerts": [risk]}]
    run_promtool(tmp_path, "gpuhealth", ["evidence", "fusion"],
                 [{"interval": "5s", "input_series": fleet.input_series(), "alert_rule_test": checks}],
                 evaluation_interval="5s", rules_dir=out)
    assert Path(out / "alertmanager.yml").is_file()


def test_a_value_missing_from_the_catalogue_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Templates render with StrictUndefined: a required value that is gone fails loudly, no traceback."""
    text = catalogue.BUILTIN.read_text()
    broken = tmp_path / "catalogue.yaml"
    reasons = "      reasons: sw_thermal_slowdown|hw_thermal_slowdown\n"
    assert reasons in text
    broken.write_text(text.replace(reasons, "", 1))
    monkeypatch.setattr(catalogue, "BUILTIN", broken)
    assert main(["rules", "generate", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "has no attribute 'reasons'" in err and "Traceback" not in err


def test_no_rule_is_generated_twice():
    """Two rules of one group that write the same series collide at every evaluation: a signal whose
    evidence is split into groups by GPU index is still fused by one rule."""
    repeated = []
    for path in sorted(GENERATED.rglob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            seen = set()
            for rule in group["rules"]:
                key = (rule.get("record") or rule.get("alert"), rule["expr"],
                       tuple(sorted((rule.get("labels") or {}).items())))
                if key in seen:
                    repeated.append(f"{path.relative_to(GENERATED)} {group['name']}: {key[0]}")
                seen.add(key)
    assert not repeated, repeated
