"""The docs: links that resolve, file paths that exist, and the example that runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:supervisor|actors|environments|sandbox|judges|chaos|configs|"
                       r"tests|bench|docs)/[\w./-]*\.(?:py|yaml|md|png))`")


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(root: Path) -> list[str]:
    """Every relative link (and image) in README.md and docs/ whose file or anchor is
    missing."""
    broken = []
    for page in pages(root):
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for match in LINK.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def missing_paths(root: Path) -> list[str]:
    """Repository paths named in backticks that do not exist (a moved or deleted file)."""
    missing = []
    for page in pages(root):
        for match in CODE_PATH.finditer(page.read_text(encoding="utf-8")):
            if "*" not in match.group(1) and not (root / match.group(1)).exists():
                missing.append(f"{page.relative_to(root)}: {match.group(1)}")
    return missing


def test_every_relative_link_resolves() -> None:
    assert broken_links(REPO) == []


def test_every_named_file_exists() -> None:
    assert missing_paths(REPO) == []


def test_a_planted_broken_link_and_a_stale_path_are_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Alpha beta\n\nSee `actors/gone.py`.\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#alpha-beta) [no file](docs/b.md) [no heading](docs/a.md#gamma)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md (no such file)",
                                      "README.md: docs/a.md#gamma (no such heading)"]
    assert missing_paths(tmp_path) == ["docs/a.md: actors/gone.py"]


def test_the_readme_opens_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert blocks[0].endswith("erlay run configs/cpu.yaml")
    ci = (REPO / ".ci" / "run").read_text()
    assert blocks[1] in ci, "the README's test command is the one .ci/run runs"
    assert len(readme.splitlines()) <= 320


@pytest.mark.ray
def test_the_supervision_demo_recovers_every_fault() -> None:
    result = subprocess.run([sys.executable, str(REPO / "docs" / "examples" /
                                                 "supervision_demo.py"),
                             "--kills", "4", "--interval", "0.2"],
                            capture_output=True, text=True, timeout=240, cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4/4 faults recovered" in result.stdout and "0 orphans" in result.stdout
