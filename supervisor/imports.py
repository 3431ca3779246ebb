"""Resolving ``"module:attr"`` paths, the way specs and configs name classes.

One resolver for the whole project, so every "cannot import" error reads the same: it names
what was being loaded (a judge, an environment, a hosted child), the module or attribute that
is missing, and the path as given.

erlay's modules live under one import name, ``erlay``.  A path in the old, bare form
(``environments.arithmetic:ArithmeticEnv``) that does not import as given, but would under
``erlay.``, fails with one line that names the new path (:func:`renamed_path`).  A user's own
package that happens to be called ``environments`` still imports as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

# The top-level names erlay's packages had before they moved under ``erlay``.
OLD_TOP_LEVEL = ("supervisor", "actors", "environments", "sandbox", "judges", "chaos",
                 "configs")


def renamed_path(path: str) -> str | None:
    """``erlay.<path>`` when ``path`` names a module of erlay's old bare layout: one that
    exists under ``erlay`` and that, under the bare name, is missing or is erlay's own file
    (found through a checkout on ``sys.path``, which would import erlay's code twice under two
    names).  None otherwise, e.g. for a user's own ``environments`` package."""
    module_name = path.partition(":")[0]
    if module_name.split(".")[0] not in OLD_TOP_LEVEL:
        return None
    new = _origin(f"erlay.{module_name}")
    if new is None:
        return None
    old = _origin(module_name)
    return f"erlay.{path}" if old is None or old == new else None


def _origin(module_name: str) -> str | None:
    """The file ``module_name`` would load from, without importing it (parents are)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent is missing, or is not a package
        return None
    return None if spec is None or spec.origin is None else os.path.realpath(spec.origin)


def import_path(path: str, what: str = "object") -> Any:
    """The object at ``"module:attr"`` (``attr`` may be dotted).

    Raises ValueError for a malformed path, ImportError naming the module, AttributeError
    naming the attribute; each message says ``what`` was being loaded.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} path must be 'module:Class' (module:attr), got {path!r}")
    if (new := renamed_path(path)) is not None:
        raise ImportError(f"{what} path {path!r} is erlay's old layout: erlay's modules are "
                          f"under 'erlay.' now; use {new!r}", name=module_name)
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
