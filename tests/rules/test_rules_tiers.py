"""Rule tiers: shard files read one node's raw series, global files only what the shards remote-write."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all
from rules_promtool import SOURCES

from gpuhealth.cli import main
from gpuhealth.evaluation.rulefiles import selectors


def series_read(expr: str) -> set[str | None]:
    """Metric names an expression selects (None for a selector by matchers alone)."""
    return {selector.name for selector in selectors(expr)}


def rules(files: dict[str, str], source: str) -> list[dict[str, Any]]:
    return [rule for path, text in files.items() if path.startswith(f"{source}/")
            for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def test_series_read_finds_selected_metrics_only():
    expr = ('max by (cluster, node) (ALERTS{alertname!="X"} offset 1h) > on (cluster) group_left (model) '
            'quantile by (cluster) (0.9, rate(a_total{type="c"}[5m])) unless gpuhealth:x:y')
    assert series_read(expr) == {"ALERTS", "a_total", "gpuhealth:x:y"}


@pytest.mark.parametrize("source", SOURCES)
def test_shard_and_global_split_the_single_tier(source):
    """Every rule runs in exactly one tier, so a sharded deployment evaluates what one Prometheus does."""
    cat = catalogue.load()
    single, shard, glob = (render_all(cat, (source,), tier) for tier in catalogue.TIERS)
    assert set(shard) & set(glob) == {"alertmanager.yml"}
    assert set(shard) | set(glob) == set(single)
    assert {p for p in glob if p != "alertmanager.yml"} == {f"{source}/{g}.yml" for g, t in cat.tiers.items()
                                                            if t == "global"}
    for path in set(single) - {"alertmanager.yml"}:
        tiered = shard.get(path) or glob[path]
        assert yaml.safe_load(tiered) == yaml.safe_load(single[path])


@pytest.mark.parametrize("source", SOURCES)
def test_global_rules_read_only_what_shards_send(source):
    """vmalert sees only the remote-written series: a global rule reading a raw exporter series would
    be silently empty there."""
    sent = re.compile(catalogue.REMOTE_WRITE_SERIES)
    global_rules = rules(render_all(catalogue.load(), (source,), "global"), source)
    assert global_rules
    for rule in global_rules:
        read = series_read(rule["expr"])
        name = rule.get("alert") or rule["record"]
        assert read and all(series and sent.fullmatch(series) for series in read), (name, read)


@pytest.mark.parametrize("source", SOURCES)
def test_no_shard_rule_reads_a_global_result(source):
    """Shards never see what the global tier computes (fleet-wide records, its alerts): a shard rule
    reading one would see nothing, or only its own share of the fleet."""
    cat = catalogue.load()
    global_rules = rules(render_all(cat, (source,), "global"), source)
    produced = {r["record"] for r in global_rules if "record" in r}
    if any("alert" in r for r in global_rules):
        produced.add("ALERTS")
    for rule in rules(render_all(cat, (source,), "shard"), source):
        assert not series_read(rule["expr"]) & produced, rule.get("alert") or rule["record"]


def test_tier_comes_from_the_catalogue():
    moved = catalogue.resolve({"tiers": {"lemon": "shard", "fleet": "shard", "meta": "global"}})
    assert "gpuhealth/lemon.yml" in render_all(moved, ("gpuhealth",), "shard")
    assert set(render_all(moved, ("gpuhealth",), "global")) == {"gpuhealth/meta.yml", "alertmanager.yml"}


def test_bad_tiers_are_listed():
    with pytest.raises(catalogue.CatalogueError) as exc:
        catalogue.resolve({"tiers": {"lemon": "fleet", "bogus": "shard"}})
    assert set(exc.value.errors) == {"tiers.bogus: unknown key (not in the built-in catalogue)",
                                     "tiers.lemon: must be shard or global, got 'fleet'"}


def test_cli_renders_one_tier(tmp_path, capsys):
    assert main(["rules", "generate", "--tier", "shard"]) == 2
    assert "--tier shard needs --out" in capsys.readouterr().err
    out = str(tmp_path)
    assert main(["rules", "generate", "--tier", "global", "--source", "gpuhealth", "--out", out]) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.yml")) == [
        "alertmanager.yml", "gpuhealth/fleet.yml", "gpuhealth/lemon.yml"]
    assert "global tier" in (tmp_path / "gpuhealth" / "lemon.yml").read_text().splitlines()[0]
