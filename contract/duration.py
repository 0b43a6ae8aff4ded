"""Prometheus durations, one grammar for every component: ``1h30m``, ``500ms``, ``1w``, ``1y``, ``0``.

The grammar is Prometheus's own (``model.ParseDuration``): whole numbers of the units y (365 days),
w, d, h, m, s and ms, largest first, each at most once, or a bare ``0``. A fraction such as ``1.5h``
is refused, as Prometheus refuses it in a rule's ``for:`` and in a range selector: a duration
accepted in any gpuhealth file means the same when it reaches Prometheus (write ``1h30m``).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

UNITS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
PATTERN = "^(0|" + "".join(f"([0-9]+{unit})?" for unit in UNITS) + ")$"
_GRAMMAR = re.compile(PATTERN)
_PART = re.compile(r"([0-9]+)(ms|[ywdhms])")
MAX_SECONDS = (2**63 - 1) / 1e9  # Prometheus keeps a duration in int64 nanoseconds
HINT = "whole numbers with units y, w, d, h, m, s, ms, largest first, e.g. 30s, 1h30m, 500ms, 1w"


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration; ``ValueError`` naming the value and the grammar otherwise."""
    if not isinstance(text, str) or not text or not _GRAMMAR.fullmatch(text):
        raise ValueError(f"{text!r} is not a duration ({HINT})")
    seconds = sum(int(number) * UNITS[unit] for number, unit in _PART.findall(text))
    if seconds > MAX_SECONDS:
        raise ValueError(f"{text!r} is longer than Prometheus can hold (about 292 years)")
    return seconds


class Duration(str):
    """A Prometheus duration that keeps its text (for rule files) and knows its ``seconds``.

    As a pydantic field it accepts a string in the grammar above; the JSON Schema carries the same
    pattern, so an editor flags ``1.5h`` before the service does."""

    __slots__ = ()

    @property
    def seconds(self) -> float:
        return parse_duration(self)

    @classmethod
    def _validate(cls, value: Any) -> Duration:
        if not isinstance(value, str):
            raise PydanticCustomError("duration", "expected a duration such as 30s or 1h30m, got {value}",
                                      {"value": repr(value)})
        try:
            parse_duration(value)
        except ValueError as exc:
            raise PydanticCustomError("duration", str(exc)) from None
        return cls(value)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate, serialization=core_schema.plain_serializer_function_ser_schema(str))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "string", "minLength": 1, "pattern": PATTERN,
                "description": f"A Prometheus duration: {HINT} (a fraction such as 1.5h is refused, as "
                               "Prometheus refuses it)."}


class Seconds:
    """Field metadata: a Prometheus duration or a plain number of seconds, read as float seconds.

    For files whose times have always been numbers (simulator and benchmark scenarios), so that old
    files keep their meaning while new ones may write ``1h30m``. ``positive`` refuses 0 as well."""

    __slots__ = ("positive",)

    def __init__(self, *, positive: bool = True) -> None:
        self.positive = positive

    def validate(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise PydanticCustomError("duration", "expected a duration such as 30s or 1h30m, or a number of "
                                      "seconds, got {value}", {"value": repr(value)})
        try:
            seconds = parse_duration(value) if isinstance(value, str) else float(value)
        except ValueError as exc:
            raise PydanticCustomError("duration", str(exc)) from None
        if not math.isfinite(seconds):
            raise PydanticCustomError("duration", "expected a finite number of seconds, got {value}",
                                      {"value": repr(value)})
        if seconds < 0 or (self.positive and seconds == 0):
            raise PydanticCustomError("duration", "must be positive" if self.positive else "must be >= 0")
        return float(seconds)

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        number: dict[str, Any] = {"type": "number", ("exclusiveMinimum" if self.positive else "minimum"): 0}
        return {"anyOf": [Duration.__get_pydantic_json_schema__(schema, handler), number],
                "description": "A Prometheus duration (30s, 1h30m) or a number of seconds."}


PositiveSeconds = Annotated[float, Seconds()]
Offset = Annotated[float, Seconds(positive=False)]  # seconds from a start; 0 allowed
