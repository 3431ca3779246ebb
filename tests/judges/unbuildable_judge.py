"""A judge whose constructor fails on purpose, loaded as
"tests.judges.unbuildable_judge:UnbuildableJudge", for preflight's build tests.

``fault`` is one of :func:`tests.environments.unbuildable_env.plant`'s; with none it is the
math judge.
"""

from __future__ import annotations

from erlay.judges.math import MathJudge
from tests.environments.unbuildable_env import plant


class UnbuildableJudge(MathJudge):
    def __init__(self, fault: str | None = None, pid_file: str | None = None) -> None:
        plant(fault, pid_file)
        super().__init__()
