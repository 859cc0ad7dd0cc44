"""The docs' promises point at tests that exist: every `tests/<file>.py::<test>` in docs/ and the README, and
every bare `::<test>`, read as a test of the last file named before it."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"`(tests/test_\w+\.py)?::(test_\w+)(\*?)`")  # a trailing * names every test so begun
TEST_FILE = re.compile(r"\btests/test_\w+\.py\b")


def defined_tests() -> dict[str, set[str]]:
    """{tests/<file>.py: names of its test functions}."""
    return {f"tests/{path.name}": set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
            for path in (REPO / "tests").glob("test_*.py")}


def unresolved(text: str, tests: dict[str, set[str]]) -> list[str]:
    """The references in ``text`` that name no test (a bare one: none of the last named file)."""
    wrong, last = [], None
    for match in REFERENCE.finditer(text):
        last = match.group(1) or last
        name, prefix = match.group(2), match.group(3) == "*"
        names = tests.get(last, set())
        if last is None or not (any(test.startswith(name) for test in names) if prefix else name in names):
            wrong.append(f"{last}::{name}{match.group(3)}")
    return wrong + [file for file in TEST_FILE.findall(text) if file not in tests]


def test_every_test_the_docs_name_exists_in_the_file_they_name():
    tests = defined_tests()
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    wrong = {doc.name: found for doc in documents if (found := unresolved(doc.read_text(encoding="utf-8"), tests))}
    assert wrong == {}


def test_a_bare_reference_is_read_against_the_last_file_named():
    tests = {"tests/test_a.py": {"test_one"}, "tests/test_b.py": {"test_two"}}
    assert unresolved("`tests/test_a.py::test_one` `::test_one` `tests/test_b.py::test_two` `::test_two`", tests) == []
    assert unresolved("`tests/test_a.py::test_one` `::test_two`", tests) == ["tests/test_a.py::test_two"]
    assert unresolved("`::test_one`", tests) == ["None::test_one"]
    assert unresolved("`tests/test_a.py::test_o*` `tests/test_b.py::test_o*`", tests) == ["tests/test_b.py::test_o*"]
    assert unresolved("run `pytest tests/test_a.py` and `tests/test_c.py`", tests) == ["tests/test_c.py"]
