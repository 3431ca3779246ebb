"""Resolving ``"module:attr"`` paths, the way specs and configs name classes.

One resolver for the whole project, so every "cannot import" error reads the same: it names
what was being loaded (a judge, an environment, a hosted child), the module or attribute that
is missing, and the path as given.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_path(path: str, what: str = "object") -> Any:
    """The object at ``"module:attr"`` (``attr`` may be dotted).

    Raises ValueError for a malformed path, ImportError naming the module, AttributeError
    naming the attribute; each message says ``what`` was being loaded.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} path must be 'module:Class' (module:attr), got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {what} module {module_name!r} (from {path!r}): {exc}",
                          name=module_name) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{what} module {module_name!r} has no attribute {attr!r}",
                                 name=attr, obj=module)
        obj = getattr(obj, part)
    return obj
