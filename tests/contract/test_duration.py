"""One Prometheus duration grammar for every component, checked against Prometheus's own parser."""

from __future__ import annotations

import shutil
import subprocess

import jsonschema
import pytest
import yaml
from gpuhealth.contract.duration import Duration, parse_duration
from gpuhealth.contract.validation import Model, problems
from pydantic import ValidationError

ACCEPTED = {"0": 0, "0s": 0, "90s": 90, "1h30m": 5400, "500ms": 0.5, "1w": 604800, "1y": 31536000,
            "1d12h": 129600, "1y2w3d4h5m6s7ms": 31536000 + 2 * 604800 + 3 * 86400 + 4 * 3600 + 5 * 60 + 6.007}
REFUSED = ["1.5h", "0.5s", "", "30m1h", "1d1y", "1h1h", "1h30", "90", "5 m", "-1s", " 5m", "1H", "m",
           "9999999999y"]


@pytest.mark.parametrize(("text", "seconds"), ACCEPTED.items())
def test_every_prometheus_unit_in_order(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", REFUSED)
def test_refusals_name_the_value_and_the_grammar(text):
    with pytest.raises(ValueError, match=r"is not a duration|longer than Prometheus can hold") as caught:
        parse_duration(text)
    assert repr(text) in str(caught.value)


def test_numbers_are_not_durations():
    for value in (90, 1.5, True, None):
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(value)


def test_prometheus_agrees_on_every_case(tmp_path):
    """Each accepted value loads as a rule's ``for:`` in promtool, and each refused one fails there."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package 'prometheus' (scripts/bootstrap.sh)")
    path = tmp_path / "rules.yml"
    verdicts = {}
    for text in [*ACCEPTED, *REFUSED]:
        rule = {"alert": "A", "expr": "up == 0", "for": text}
        path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [rule]}]}))
        done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, timeout=60)
        verdicts[text] = done.returncode == 0
    assert verdicts == {**dict.fromkeys(ACCEPTED, True), **dict.fromkeys(REFUSED, False)}


class _Window(Model):
    window: Duration
    step: Duration = Duration("1m")


def test_a_duration_field_keeps_its_text_and_knows_its_seconds():
    model = _Window.model_validate({"window": "1h30m"})
    assert model.window == "1h30m" and model.window.seconds == 5400 and model.step.seconds == 60
    assert model.model_dump() == {"window": "1h30m", "step": "1m"}


def test_a_bad_duration_field_is_one_line_with_its_location():
    with pytest.raises(ValidationError) as caught:
        _Window.model_validate({"window": "1.5h", "step": 60})
    assert problems(caught.value) == [
        "window: '1.5h' is not a duration (whole numbers with units y, w, d, h, m, s, ms, largest first, "
        "e.g. 30s, 1h30m, 500ms, 1w)",
        "step: expected a duration such as 30s or 1h30m, got 60",
    ]


def test_the_json_schema_agrees_with_the_parser():
    schema = _Window.model_json_schema()
    for text in [*ACCEPTED, *REFUSED]:
        if text == "9999999999y":
            continue  # the overflow is beyond what a pattern says; the service still refuses it
        valid = jsonschema.Draft202012Validator(schema).is_valid({"window": text})
        assert valid == (text in ACCEPTED), text

