"""The configuration reference, generated from the pydantic models of :mod:`erlay.actors.config`.

    python -m erlay.actors.config.reference > docs/configuration.md

The page lists every key of :class:`~erlay.actors.config.JobConfig` with its type, default,
bounds and description, section by section, so it cannot drift from the code: a test
regenerates it and compares (``tests/actors/test_config.py``).

May import: erlay.actors.config.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from erlay.actors.config import JobConfig

HEADER = """# Configuration reference

Generated from the pydantic models in `actors/config/` by
`python -m erlay.actors.config.reference`; do not edit by hand. A job config is YAML with
these sections; every key has the default shown. Override any key on the command line as
`key.sub=value` (the value is parsed as YAML), e.g. `erlay run configs/cpu.yaml
learner.lr=1e-4 run.steps=50`. An unknown key, a wrong type or a value out of bounds fails
before anything starts, with exit code 2 and the key named.
"""


def type_name(annotation: Any) -> str:
    """A short, readable name for a field's annotation."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def bounds_text(field: FieldInfo) -> str:
    words = []
    for meta in field.metadata:
        for name, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(meta, name, None)
            if value is not None:
                words.append(f"{symbol} {value}")
    return ", ".join(words)


def section_rows(model: type[BaseModel], prefix: str) -> list[tuple[str, list[str]]]:
    """(section key, table rows) for ``model`` and each nested section, depth first."""
    rows: list[str] = []
    nested: list[tuple[str, list[str]]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.extend(section_rows(annotation, f"{key}."))
            continue
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{key}` | {type_name(annotation)} | {default_text(field)} | "
                    f"{bounds_text(field)} | {description} |")
    return [(prefix.rstrip("."), rows), *nested] if rows else nested


def render() -> str:
    """The whole reference page, as Markdown."""
    out = [HEADER]
    for section, rows in section_rows(JobConfig, ""):
        out.append(f"## `{section}`\n")
        out.append("| key | type | default | bounds | description |")
        out.append("|---|---|---|---|---|")
        out.extend(rows)
        out.append("")
    return "\n".join(out)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
