"""Errors of chaos scenarios, worded like the job config's (``actors/config.py``).

A :class:`ScenarioError` names the file, the key path (``faults.2.params.attack``), what was
expected and what was given, with a did-you-mean for an unknown key or name.  The helpers
here turn pydantic's errors into those lines; they know the schema only through the
``type_at`` walk the caller passes in, so this module imports nothing of the scenario's.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from erlay.supervisor.errors import ErlayError

# A problem found by a validator: (key path relative to the model raising it, text, given).
Problem = tuple[tuple[Any, ...], str, Any]
# Hook of :func:`type_at`: (model, field name, raw value of the model, field annotation) ->
# the annotation to walk into (a field whose type depends on a sibling's value).
FieldType = Callable[[type[BaseModel], str, Any, Any], Any]


class ScenarioError(ErlayError):
    """A chaos scenario is invalid; ``problems`` holds one line per offending key."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = problems or [message]
        super().__init__(message)


class _Nothing:
    """The "given" of a key that was not given at all."""

    def __repr__(self) -> str:
        return "nothing"


NOTHING: Any = _Nothing()


def invalid(problems: list[Problem]) -> ValidationError:
    """A ValidationError whose errors sit at the given keys.  Raised in a validator, pydantic
    prefixes the keys of the enclosing models, so a nested model's problems land in place."""
    details: list[InitErrorDetails] = [
        {"type": PydanticCustomError("scenario", "{text}", {"text": text}), "loc": loc,
         "input": given} for loc, text, given in problems]
    return ValidationError.from_exception_data("Scenario", details)


def relocated(exc: ValidationError, prefix: tuple[Any, ...]) -> ValidationError:
    """``exc``'s errors under ``prefix``: a sub-model validated by hand reports in place."""
    details: list[InitErrorDetails] = []
    for err in exc.errors():
        kind: Any = err["type"]
        if kind not in ("missing", "extra_forbidden"):
            kind = PydanticCustomError(err["type"], "{text}", {"text": err["msg"]})
        details.append({"type": kind, "loc": (*prefix, *err["loc"]), "input": err["input"]})
    return ValidationError.from_exception_data("Scenario", details)


def describe(error: Any, type_at: Callable[[tuple[Any, ...]], Any]) -> str:
    """One line for one pydantic error: the key path, what was expected, what was given and
    a did-you-mean.  ``type_at(loc)`` is the schema's annotation at a key path (or None)."""
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc) or "<top level>"
    given = error.get("input")
    if error["type"] == "extra_forbidden":
        names = field_names(_optional_inner(type_at(loc[:-1])))
        hint = did_you_mean(str(loc[-1]), names) or (
            f"; expected one of {', '.join(names)}" if names else "")
        return f"{key}: unknown key (given {given!r}){hint}"
    if error["type"] == "missing":
        wanted = _expected(type_at(loc))
        return f"{key}: required key is missing" + (f" (expected {wanted})" if wanted else "")
    text = str(error["msg"]).removeprefix("Value error, ")
    text = re.sub(r"^Input should be ", "expected ", text)
    if error["type"] == "scenario" and given is NOTHING:
        return f"{key}: {text}"
    hint = ""
    options = get_args(_optional_inner(type_at(loc))) if error["type"] == "literal_error" \
        else ()
    if options and isinstance(given, str):
        hint = did_you_mean(given, [str(o) for o in options])
    return f"{key}: {text} (given {given!r}){hint}"


def type_at(root: type[BaseModel], loc: tuple[Any, ...], data: Any,
            field_type: FieldType | None = None) -> Any:
    """The annotation at key path ``loc`` below ``root`` for the raw ``data``, or None where
    the path leaves the schema.  A list or tuple index gives the item type."""
    ann: Any = root
    raw = data
    for part in loc:
        ann = _optional_inner(ann)
        if isinstance(part, int):
            args = [a for a in get_args(ann) if a is not Ellipsis]
            ann = args[0] if args else None
            raw = raw[part] if isinstance(raw, list) and 0 <= part < len(raw) else None
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            found = next(((n, f) for n, f in ann.model_fields.items() if part in (n, f.alias)),
                         None)
            if found is None:
                return None
            name, field = found
            child = field.annotation
            if field_type is not None:
                child = field_type(ann, name, raw, child)
            ann = child
            raw = raw.get(part) if isinstance(raw, dict) else None
        else:
            return None
    return ann


def field_names(model: Any) -> list[str]:
    """The keys a model accepts (aliases where set); [] for anything else."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return [f.alias or n for n, f in model.model_fields.items()]
    return []


def did_you_mean(given: str, names: tuple[str, ...] | list[str]) -> str:
    """``; did you mean 'x'?`` for the closest of ``names``, or ''."""
    close = difflib.get_close_matches(given, list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def one_line(exc: Exception) -> str:
    """A multi-line error (a ConfigError's) as one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]  # "invalid configuration:" says nothing the key lines don't
    # ... nor does its one-line form's prefix
    return "; ".join(lines).removeprefix("invalid configuration: ")


def _optional_inner(ann: Any) -> Any:
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def _expected(ann: Any) -> str:
    inner = _optional_inner(ann)
    if inner is not ann:
        wanted = _expected(inner)
        return f"{wanted} or null" if wanted else ""
    if get_origin(ann) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(ann))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if ann in names:
        return names[ann]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "a mapping of " + ", ".join(field_names(ann))
    if get_origin(ann) is dict:
        return "a mapping"
    return ""
