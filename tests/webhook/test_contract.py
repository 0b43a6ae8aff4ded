"""The action vocabulary, held together across components: the webhook's table (webhook/actions.py),
the contract (docs/contract.md), the rules' catalogue and generated rules, and the benchmark.

The components never import each other at run time; this test reads all of them, so that a kind
added or changed in one place and not the others fails here rather than on a production node.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from gpuhealth.rules import catalogue
from gpuhealth.webhook.actions import ALERT_ACTIONS, DRAINING, KINDS, STEPS

from gpuhealth.evaluation.matching import DRAINING_ACTIONS

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = (ROOT / "docs" / "contract.md").read_text()


def _table(heading: str) -> list[list[str]]:
    """The rows of the first Markdown table whose header row starts with ``heading``, cells unquoted."""
    lines = CONTRACT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"| {heading} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip().startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    return rows


def _yes(cell: str) -> bool:
    assert cell in ("yes", "no"), cell
    return cell == "yes"


def test_the_contract_lists_the_webhook_action_table_row_for_row():
    rows = _table("action")
    assert [r[0] for r in rows] == list(ALERT_ACTIONS), "same kinds, in the same (cooldown) order"
    for name, steps, drains, undone, needs_gpu in rows:
        kind = KINDS[name]
        assert tuple(s.strip() for s in steps.split(",") if s.strip()) == kind.steps, name
        assert (_yes(drains), _yes(undone), _yes(needs_gpu)) == (kind.drains, kind.undone_on_resolve,
                                                                 kind.needs_gpu), name


def test_every_step_of_the_table_is_a_known_step():
    assert {step for kind in KINDS.values() for step in kind.steps} == set(STEPS)


def test_the_rules_catalogue_uses_only_actions_the_webhook_knows():
    assert catalogue.ACTIONS == ALERT_ACTIONS
    data = yaml.safe_load((ROOT / "rules" / "catalogue.yaml").read_text())
    used = {alert["action"] for alert in data["alerts"].values()}
    assert used <= set(ALERT_ACTIONS) and "none" in used
    assert set(data["defaults"]["xid"]["recovery_actions"]) <= set(ALERT_ACTIONS)
    # the lemon-node count and the benchmark treat as "the node was taken out" what the webhook drains
    assert set(data["defaults"]["lemon"]["actions"]) == set(DRAINING)
    assert set(DRAINING_ACTIONS) == set(DRAINING)


@pytest.mark.parametrize("rules", sorted((ROOT / "rules" / "generated").glob("*/*.yml")), ids=str)
def test_every_generated_alert_asks_for_a_known_action(rules):
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["action"] in ALERT_ACTIONS, rule["alert"]


def test_alerts_whose_action_acts_on_a_gpu_carry_the_gpu_label():
    """An action that needs a GPU is refused (``no_gpu``) for an alert without one: the contract's alert
    table must give every such alert its ``gpu`` label."""
    alerts = {row[0]: row for row in _table("alert")}
    data = yaml.safe_load((ROOT / "rules" / "catalogue.yaml").read_text())
    assert set(alerts) == set(data["alerts"])
    for name, labels, _severity, action in alerts.values():
        assert action == data["alerts"][name]["action"], name
        if KINDS[action].needs_gpu:
            assert "gpu" in re.findall(r"[a-z_]+", labels), f"{name} ({action}) has no gpu label"


def test_the_contract_lists_every_webhook_metric_with_its_labels_and_type():
    from gpuhealth.webhook.metrics import Metrics

    section = CONTRACT[CONTRACT.index("## Webhook metrics"):]
    listed = {}
    for line in section.splitlines()[3:]:
        if not line.startswith("| `gpuhealth_webhook_"):
            break
        metric, kind = (cell.strip().strip("`") for cell in line.strip("|").split("|"))
        name, _, labels = metric.partition("{")
        listed[name] = (kind, tuple(sorted(filter(None, labels.rstrip("}").split(",")))))
    metrics = Metrics()
    metrics.claimed_actions.labels("replica-a")  # its series appear once a replica is known
    published = {}
    for family in metrics.registry.collect():
        suffix = "_total" if family.type == "counter" else ""
        labels = {label for sample in family.samples for label in sample.labels if label != "le"}
        published[family.name + suffix] = (family.type, tuple(sorted(labels)))
    assert listed == published
