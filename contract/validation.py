"""One validation style for every file gpuhealth reads: strict pydantic models, every problem at once.

A problem is one line, ``location: what is wrong`` (``policy.rules[0].action: 'explode' is not one
of ...``), so that an operator fixes a file in one pass and never reads a traceback. Models are
strict (YAML's ``"false"`` is not false, ``2.9`` GPUs are not 2) and closed (an unknown key is a
typo until proven otherwise).
"""

from __future__ import annotations

import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import InitErrorDetails, PydanticCustomError, core_schema
from pydantic_core.core_schema import CoreSchema, ErrorType

Location = tuple[str | int, ...]
_BUILTIN_TYPES = frozenset(typing.get_args(ErrorType))
_EXPECTED = {
    "bool_type": "a boolean (true or false)", "bool_parsing": "a boolean (true or false)",
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "string_type": "a string", "list_type": "a list", "tuple_type": "a list", "set_type": "a list",
    "path_type": "a path",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def where(loc: Iterable[str | int], prefix: str = "") -> str:
    """``("policy", "rules", 0, "action")`` -> ``policy.rules[0].action``."""
    text = prefix
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _shown(value: Any) -> str:
    return f"{value!r:.60}"


def _message(error: Any) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {_shown(value)}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_shown(value)}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        noun = "an integer" if isinstance(bound, int) else "a number"
        return f"expected {noun} {_BOUNDS[kind]} {bound:g}, got {_shown(value)}"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length')} item(s), got {ctx.get('actual_length')}"
    if kind == "string_too_short":
        return f"expected at least {ctx.get('min_length')} character(s), got {_shown(value)}"
    if kind == "literal_error":
        return f"{_shown(value)} is not one of {ctx.get('expected', '').replace(' or ', ', ')}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return str(error["msg"])


def problems(exc: ValidationError, prefix: str = "") -> list[str]:
    """Every problem in ``exc`` as ``location: message``, in document order; ``prefix`` names the
    section the model read (``backend`` for a backend's settings)."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = where(error["loc"], prefix)
        lines.append(f"{loc}: {_message(error)}" if loc else _message(error))
    return lines


def _rebuildable(error: Any) -> InitErrorDetails:
    """An error of a nested model, in a form ``from_exception_data`` takes back unchanged."""
    kind = error["type"]
    if kind in _BUILTIN_TYPES:
        return InitErrorDetails(type=kind, loc=error["loc"], input=error["input"], ctx=error.get("ctx") or {})
    return InitErrorDetails(type=PydanticCustomError(kind, "{message}", {"message": error["msg"]}),
                            loc=error["loc"], input=error["input"])


class Model(BaseModel):
    """Base of every model of a file gpuhealth reads: strict, closed, immutable, errors listed together.

    A key with no value (YAML's ``key:``) is as if it were absent: its default applies.

    ``cross_check`` holds rules that span several fields. It reads the raw mapping, so that its
    problems are listed beside the field problems (an after-validator would run only once every
    field is valid, and an operator would fix the file twice)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> Sequence[tuple[Location, str]]:
        return ()

    @model_validator(mode="wrap")
    @classmethod
    def _listed_together(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(data, dict):
            data = {key: value for key, value in data.items() if value is not None}
        found = cls.cross_check(data) if isinstance(data, dict) else ()
        extra = [InitErrorDetails(type=PydanticCustomError("cross_check", "{message}", {"message": message}),
                                  loc=loc, input=data) for loc, message in found]
        try:
            result = handler(data)
        except ValidationError as exc:
            if not extra:
                raise
            raise ValidationError.from_exception_data(
                exc.title, [*map(_rebuildable, exc.errors(include_url=False)), *extra]) from None
        if extra:
            raise ValidationError.from_exception_data(cls.__name__, extra)
        return result




class OneOf:
    """Field metadata: a string from a vocabulary kept as a tuple elsewhere (a ``Literal`` cannot be
    built from one); the JSON Schema lists the same values as an ``enum``."""

    __slots__ = ("options",)

    def __init__(self, options: Sequence[str]) -> None:
        self.options = tuple(options)

    def validate(self, value: Any) -> str:
        if not isinstance(value, str) or value not in self.options:
            raise PydanticCustomError("one_of", "{value} is not one of {options}",
                                      {"value": _shown(value), "options": ", ".join(map(repr, self.options))})
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "string", "enum": list(self.options)}
