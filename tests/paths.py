"""Paths the tests share: the repository root, wherever a test module sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
