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


def _claims() -> dict[str, list[str]]:
    """Top-level name -> distributions (other than erlay) that declare it, in one pass
    over the installed metadata (``packages_distributions`` reads each top_level.txt, or
    the file list where there is none)."""
    versions = {(d.metadata["Name"] or "?").lower(): (d.metadata["Name"] or "?", d.version)
                for d in importlib.metadata.distributions()}
    claims: dict[str, list[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        for dist in dict.fromkeys(dists):
            if dist.lower() == "erlay":
                continue
            name, version = versions.get(dist.lower(), (dist, "?"))
            claims.setdefault(top, []).append(f"{name} {version}")
    return claims


def check_install() -> list[str]:
    """Return one problem description per missing or shadowed package (empty when fine)."""
    problems = []
    claims = _claims()
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
        owners = claims.get(name, [])
        if f'ERLAY_PACKAGE = "{name}"' not in text:
            by = f" (installed by {', '.join(owners)})" if owners else ""
            problems.append(f"package '{name}' resolves to {origin.parent}{by}, which is not "
                            "erlay's: another distribution shadows it")
            continue
        if owners:
            problems.append(f"package '{name}' is also claimed by {', '.join(owners)}; its files "
                            "may have been overwritten")
    return problems
