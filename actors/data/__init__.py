"""Datasets: the ``data`` section's files or cached hub ids, loaded and checked into rows.

- :mod:`.rows`: :func:`~erlay.actors.data.rows.load_rows` reads ``data.train`` or
  ``data.validation`` with the ``datasets`` library (JSONL, JSON, Parquet, a directory of
  them, or a hub id from the local cache, never downloaded), maps the configured columns and
  checks every row, returning plain dicts of the shape
  :mod:`erlay.environments.dataset` documents.

Contract: a bad dataset is refused before anything starts, with one
:class:`~erlay.actors.config.ConfigError` line naming the file, the 1-based row and the
missing or mistyped column (``erlay run`` exits 2); an empty dataset is refused too.  Loading
writes nothing into the user's HF cache for local files and never reaches the network.

May import: erlay.supervisor, erlay.actors.config.
"""
