"""Check that the packages `erlay` imports are erlay's own.

erlay's top-level package names are generic and other PyPI distributions claim some of them
(``supervisor`` is also supervisord's package).  If one of those shadows erlay's package,
or was installed over it, erlay would import the wrong code and fail in confusing ways.
This check runs first, reads files only (imports nothing it checks), and names the culprit.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

ERLAY_PACKAGES = ("supervisor", "actors", "environments", "sandbox", "judges", "chaos",
                  "configs")
ADVICE = ("Install erlay in its own virtual environment: "
          "python3.11 -m venv .venv && .venv/bin/pip install -e .")


def _owners(name: str) -> list[str]:
    """Distributions (other than erlay) that declare the top-level name ``name``."""
    owners = []
    for dist in importlib.metadata.distributions():
        dist_name = dist.metadata["Name"] or "?"
        if dist_name.lower() == "erlay":
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        files = dist.files or []
        if name in top or any(str(f).split("/", 1)[0] == name and str(f).endswith(".py")
                              for f in files):
            owners.append(f"{dist_name} {dist.version}")
    return owners


def check_install() -> list[str]:
    """Return one problem description per missing or shadowed package (empty when fine)."""
    problems = []
    for name in ERLAY_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            problems.append(f"package '{name}' is missing; erlay's install is incomplete")
            continue
        origin = Path(spec.origin)
        try:
            text = origin.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        if f'ERLAY_PACKAGE = "{name}"' not in text:
            owners = _owners(name)
            by = f" (installed by {', '.join(owners)})" if owners else ""
            problems.append(f"package '{name}' resolves to {origin.parent}{by}, which is not "
                            "erlay's: another distribution shadows it")
            continue
        owners = _owners(name)
        if owners:
            problems.append(f"package '{name}' is also claimed by {', '.join(owners)}; its files "
                            "may have been overwritten")
    return problems
