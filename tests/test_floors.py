"""The folders are floors in pipeline order: analysis < annotation < classifier < app. A module imports only
from its own floor or below; every import counts, also one inside a function."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = ("analysis", "annotation", "classifier", "app")


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import stays inside its own package
                found.append((node.lineno, path.relative_to(REPO).parts[0]))
            elif node.module:
                found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports() -> list[str]:
    problems = []
    for level, floor in enumerate(FLOORS):
        for path in sorted((REPO / floor).rglob("*.py")):
            for line, package in imported_packages(path):
                if package in FLOORS and FLOORS.index(package) > level:
                    problems.append(f"{path.relative_to(REPO)}:{line} imports {package} (floor {floor} is below it)")
    return problems


def test_every_module_imports_only_from_its_floor_or_below():
    problems = upward_imports()
    assert not problems, "imports from a higher floor:\n" + "\n".join(problems)


def test_the_walk_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The check itself: a lazy import of a higher floor, hidden in a function, is found."""
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "lazy.py").write_text(
        "import numpy\n\n\ndef f():\n    from classifier.predict import load_classifier\n    return load_classifier\n")
    (tmp_path / "classifier").mkdir()
    (tmp_path / "classifier" / "fine.py").write_text("from analysis import lazy\nfrom . import fine\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert upward_imports() == ["analysis/lazy.py:5 imports classifier (floor analysis is below it)"]
