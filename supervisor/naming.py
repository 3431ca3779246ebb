"""Tree paths and the Ray names derived from them, so the dashboard reads like the tree.

A path is ``/``-separated from the root: ``erlay/gen/engine-2``.  Actor children are named by
their path; a host is named ``<domain path>/host@<node>``.  Ray actor names must be unique in
their namespace, and a restart reuses the name once the old incarnation is dead.
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"[^A-Za-z0-9_.@:\-/]")


def child_path(parent: str, child_id: str) -> str:
    return f"{parent}/{child_id}"


def parent_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def host_id(node_label: str) -> str:
    """The child id of the host for one node: ``host@<node>``."""
    return f"host@{safe(node_label)}"


def safe(text: str) -> str:
    """Make a label safe for a child id and a Ray actor name."""
    return _SAFE.sub("_", text)


def task_name(path: str, what: str) -> str:
    """Name of a Ray task run on behalf of ``path``, e.g. ``erlay/judge:score``."""
    return f"{path}:{safe(what)}"
