"""The shared validation style: strict closed models, every problem at once, one line each."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pytest
from gpuhealth.contract.validation import Location, Model, problems, where
from pydantic import Field, ValidationError


class _Auth(Model):
    token_file: str | None = None
    username: str | None = None

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        return [] if "token_file" in data or "username" in data else [((), "needs token_file or username")]


class _Rule(Model):
    action: Literal["none", "drain"]
    labels: dict[str, str] = Field(default_factory=dict)


class _File(Model):
    enabled: bool = False
    names: Annotated[tuple[Annotated[str, Field(min_length=1)], ...],
                     Field(strict=False, min_length=1)] = ("a",)
    count: Annotated[int, Field(gt=0)] = 1
    fraction: Annotated[float, Field(ge=0, le=1)] = 0.5
    auth: _Auth = _Auth(token_file="t")
    rules: Annotated[tuple[_Rule, ...], Field(strict=False)] = ()


def _problems(data: Any) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        _File.model_validate(data)
    return problems(caught.value)


def test_every_problem_is_listed_at_once_with_its_location():
    assert _problems({"enabled": "yes", "count": 0, "fraction": 2, "colour": "red",
                      "auth": {"colur": 1}, "rules": [{"action": "explode", "labels": {"gpu": 3}}, {}]}) == [
        "enabled: expected a boolean (true or false), got 'yes'",
        "count: expected an integer > 0, got 0",
        "fraction: expected a number <= 1, got 2",
        "auth.colur: unknown key",
        "auth: needs token_file or username",
        "rules[0].action: 'explode' is not one of 'none', 'drain'",
        "rules[0].labels.gpu: expected a string, got 3",
        "rules[1].action: required",
        "colour: unknown key",
    ]


def test_lengths_say_what_is_missing():
    assert _problems({"names": []}) == ["names: expected at least 1 item(s), got 0"]
    assert _problems({"names": ["a", ""]}) == ["names[1]: expected at least 1 character(s), got ''"]


def test_yaml_types_are_taken_as_written():
    assert _problems({"count": 2.0}) == ["count: expected an integer, got 2.0"]
    assert _problems({"count": True}) == ["count: expected an integer, got True"]
    assert _problems({"enabled": "false"}) == ["enabled: expected a boolean (true or false), got 'false'"]
    assert _problems({"auth": "token"}) == ["auth: expected a mapping, got 'token'"]


def test_a_key_with_no_value_takes_its_default():
    parsed = _File.model_validate({"enabled": None, "auth": {"username": "am", "token_file": None}})
    assert parsed.enabled is False and parsed.auth.username == "am" and parsed.auth.token_file is None


def test_locations_read_as_yaml_paths():
    assert where(("policy", "rules", 0, "match", "alertname")) == "policy.rules[0].match.alertname"
    assert where((0, "gpu"), "faults") == "faults[0].gpu"
    assert where(()) == ""
