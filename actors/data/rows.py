"""Load a dataset into checked rows: the one place erlay touches the ``datasets`` library.

A source (``data.train`` or ``data.validation``) is

- a file: ``.jsonl`` / ``.json`` (the ``json`` builder) or ``.parquet``;
- a directory: every such file under it, in sorted path order, each loaded and checked on
  its own (so an error names the file);
- anything else: a hub dataset id (``data.subset`` names its config, ``data.split`` /
  ``data.validation_split`` its split), read from the local HF cache with the ``datasets``
  offline switch on: erlay never downloads a dataset.

Local files load into memory through a throwaway cache directory, so nothing lands in the
user's HF cache.  Each row is then mapped through the configured columns into the plain dict
:mod:`erlay.environments.dataset` documents::

    {"prompt": str | None, "messages": [{"role", "content"}] | None, "answer": str,
     "metadata": {column: JSON value}, "source": "train.jsonl row 3"}

Errors are one :class:`ConfigError` line: ``data.train: FILE row 3 (line 4): column 'answer'
(data.answer) is missing``.  Rows are numbered from 1 in the order the file holds them; for a
JSONL file the line number follows (blank lines are skipped).  A column missing from a whole
file, an empty dataset, a JSONL line that is not JSON or a column whose JSON type changes
between lines are refused the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from erlay.actors.config import ConfigError
from erlay.actors.config.data import DataSection

log = logging.getLogger("erlay.data")

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MAX_ROWS = 10_000_000   # a guard against pointing data.train at the wrong thing


def load_rows(data: DataSection, which: str = "train") -> list[dict[str, Any]]:
    """The checked rows of ``data.<which>`` (``"train"`` or ``"validation"``), in source
    order; raises :class:`ConfigError` (one line) for any bad row, column or source."""
    spec = getattr(data, which)
    key = f"data.{which}"
    if spec is None:
        raise ConfigError(f"{key}: not set")
    rows: list[dict[str, Any]] = []
    for label, table, path in _tables(spec, key, data.subset,
                                      data.split if which == "train" else data.validation_split):
        rows.extend(_checked(table, data, key, label, path))
        if len(rows) > MAX_ROWS:
            raise ConfigError(f"{key}: {spec} holds more than {MAX_ROWS} rows")
    if not rows:
        raise ConfigError(f"{key}: {spec} holds no rows")
    return rows


# -- sources -----------------------------------------------------------------------------------
def _tables(spec: str, key: str, subset: str | None,
            split: str) -> Iterator[tuple[str, Any, Path | None]]:
    """``(label, datasets.Dataset, path or None)`` for each file of a local source, or the
    one split of a cached hub dataset."""
    path = Path(spec).expanduser()
    if path.is_file():
        yield str(path), _load_file(path, key), path
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise ConfigError(f"{key}: {path} holds no .jsonl, .json or .parquet file")
        for file in files:
            yield str(file), _load_file(file, key), file
    elif path.is_absolute() or spec.startswith((".", "~")) or spec.count("/") > 1 \
            or path.suffix in SUFFIXES:
        raise ConfigError(f"{key}: {spec} does not exist")
    else:
        yield f"{spec} (split {split})", _load_hub(spec, key, subset, split), None


def _quiet_datasets() -> Any:
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _load_file(path: Path, key: str) -> Any:
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{key}: {path}: expected a .jsonl, .json or .parquet file")
    if _holds_no_rows(path):  # the readers fail on these with no useful message
        raise ConfigError(f"{key}: {path} holds no rows")
    datasets = _quiet_datasets()
    try:
        with tempfile.TemporaryDirectory(prefix="erlay-data-") as cache:
            return datasets.load_dataset(SUFFIXES[path.suffix], data_files=[str(path)],
                                         split="train", cache_dir=cache, keep_in_memory=True)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure is bad input: say where
        if path.suffix == ".jsonl":
            _scan_jsonl(path, key)  # raises with the row when it can find one
        raise ConfigError(f"{key}: {path} cannot be read: {_first_line(exc)}") from None


def _holds_no_rows(path: Path) -> bool:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            return int(pq.ParquetFile(path).metadata.num_rows) == 0
        except Exception:  # noqa: BLE001 - not Parquet at all: the reader says so
            return False
    with path.open(encoding="utf-8", errors="replace") as f:
        return not any(line.strip() for line in f)


def _load_hub(spec: str, key: str, subset: str | None, split: str) -> Any:
    datasets = _quiet_datasets()
    try:
        with _offline(datasets):
            return datasets.load_dataset(spec, name=subset, split=split)
    except Exception as exc:  # noqa: BLE001 - not cached, no such split: one line either way
        raise ConfigError(f"{key}: {spec} is neither a file nor a directory, and as a hub "
                          f"dataset it is not in the local HF cache with split {split!r} "
                          f"(erlay never downloads; load it once with datasets."
                          f"load_dataset): {_first_line(exc)}") from None


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """The ``datasets`` offline switch (HF_DATASETS_OFFLINE), on for the block: a hub id
    resolves from the local cache or fails, never downloads."""
    config = datasets.config
    before = config.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE = before


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _json_type(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(value)]


def _scan_jsonl(path: Path, key: str) -> None:
    """Find the row the ``json`` reader choked on: a line that is not a JSON object, or a
    column whose JSON type differs from its first non-null value's.  Returns when it finds
    none (the caller then reports the reader's own error)."""
    seen: dict[str, tuple[str, int]] = {}
    row = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row += 1
            where = f"{key}: {path} row {row} (line {line_no})"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a JSON object, got "
                                  f"{_json_type(value) or 'null'}")
            for column, item in value.items():
                kind = _json_type(item)
                if kind is None:
                    continue
                first = seen.setdefault(column, (kind, row))
                if first[0] != kind:
                    raise ConfigError(f"{where}: column {column!r} is a {kind}, but row "
                                      f"{first[1]} made it a {first[0]} column (a column "
                                      f"holds one type)")


# -- rows --------------------------------------------------------------------------------------
def _line_of(path: Path | None, row: int) -> str:
    """`` (line N)`` for 1-based ``row`` of a JSONL file, else ""."""
    if path is None or path.suffix != ".jsonl":
        return ""
    count = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            count += bool(line.strip())
            if count == row:
                return f" (line {line_no})"
    return ""


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _checked(table: Any, data: DataSection, key: str, label: str,
             path: Path | None) -> list[dict[str, Any]]:
    columns = list(table.column_names)
    wanted = [(data.messages, "data.messages") if data.messages else (data.prompt, "data.prompt")]
    if data.answer is not None:
        wanted.append((data.answer, "data.answer"))
    wanted += [(name, "data.metadata") for name in data.metadata]
    for column, setting in wanted:
        if column not in columns:
            raise ConfigError(f"{key}: {label} has no column {column!r} ({setting}); its "
                              f"columns: {', '.join(columns) or 'none'}")
    if len(table) == 0:
        raise ConfigError(f"{key}: {label} holds no rows")
    name = path.name if path is not None else label
    out = []
    for i, raw in enumerate(table.select_columns([c for c, _ in wanted]).to_list()):
        problem = _row_problem(raw, data)
        if problem is not None:
            row = i + 1
            raise ConfigError(f"{key}: {label} row {row}{_line_of(path, row)}: {problem}")
        out.append(_row(raw, data, f"{name} row {i + 1}"))
    return out


def _row_problem(raw: dict[str, Any], data: DataSection) -> str | None:
    """What is wrong with one raw row, as the tail of the error line; None when it is fine."""
    if data.messages:
        col = f"column {data.messages!r} (data.messages)"
        messages = raw[data.messages]
        if messages is None:
            return f"{col} is missing"
        if not isinstance(messages, list) or not messages:
            return f"{col} must be a non-empty list of {{role, content}}, got " \
                   f"{_describe(messages)}"
        for j, message in enumerate(messages):
            if not isinstance(message, dict):
                return f"{col} item {j + 1} must be a {{role, content}} object, got " \
                       f"{_describe(message)}"
            for field in ("role", "content"):
                if not isinstance(message.get(field), str):
                    return f"{col} item {j + 1} has no {field!r} string (got " \
                           f"{_describe(message.get(field))})"
    else:
        col = f"column {data.prompt!r} (data.prompt)"
        prompt = raw[data.prompt]
        if prompt is None:
            return f"{col} is missing"
        if not isinstance(prompt, str):
            return f"{col} must be a string, got {_describe(prompt)}"
        if not prompt.strip():
            return f"{col} is empty"
    if data.answer is not None:
        col = f"column {data.answer!r} (data.answer)"
        answer = raw[data.answer]
        if answer is None:
            return f"{col} is missing"
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or (
                isinstance(answer, float) and not math.isfinite(answer)):
            return f"{col} must be a string or a finite number, got {_describe(answer)}"
    for column in data.metadata:
        try:
            json.dumps(raw[column], allow_nan=False)
        except (TypeError, ValueError):
            return f"column {column!r} (data.metadata) is not a JSON value: " \
                   f"{_describe(raw[column])}"
    return None


def _row(raw: dict[str, Any], data: DataSection, source: str) -> dict[str, Any]:
    answer = raw[data.answer] if data.answer is not None else ""
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # 72.0 from a float column reads as the answer 72
    messages = None
    if data.messages:
        messages = [{"role": m["role"], "content": m["content"]} for m in raw[data.messages]]
    return {"prompt": None if data.messages else raw[data.prompt], "messages": messages,
            "answer": str(answer), "metadata": {c: raw[c] for c in data.metadata},
            "source": source}


def environment_kwargs(data: DataSection, kwargs: dict[str, Any],
                       rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The environment's constructor kwargs with the dataset's ``rows`` and ``shuffle``
    (an environment that plays dataset rows accepts both, see
    :mod:`erlay.environments.dataset`)."""
    return {**kwargs, "rows": rows, "shuffle": data.shuffle}
