"""The docs' promises point at tests that exist: every `tests/<file>.py::<test>` in docs/ and the README, and
every bare `::<test>`, read as a test of the last file named before it."""
from __future__ import annotations

import re
from pathlib import Path

import typer

from app.cli import app

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


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCED = re.compile(r"```\w*\n(.*?)```", re.S)
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)  # ``a `b` c`` is one span, as Markdown reads it


def code_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text outside its fenced blocks, each on one line."""
    return [" ".join(span.split()) for _, span in CODE_SPAN.findall(FENCED.sub("", text))]


def command_lines(text: str, inline: bool) -> list[str]:
    """The `attnpat ...` commands of a document: each line of its fenced blocks that starts with one (its #
    comment cut off) and, with ``inline``, each code span outside them that holds one (a span's `&&` parts apart)."""
    commands = [line.split("#")[0] for block in FENCED.findall(text) for line in block.splitlines()
                if line.startswith("attnpat ")]
    if inline:
        for span in code_spans(text):
            commands += [part[part.index("attnpat "):] for part in span.split("&&")
                         if "attnpat " in part]
    return commands


def unknown_verbs_and_options(command: str, root) -> list[str]:
    """What ``command`` names that the CLI does not have: an unknown verb (or group sub-verb), or an option that
    its verb's --help does not list. ``root``: the CLI's click command."""
    words = command.split()[1:]
    if not words or words[0] not in root.commands:
        return [f"{command}: no verb {words[:1]}"]
    verb = root.commands[words[0]]
    if hasattr(verb, "commands"):  # a group (annotate, models): every sub-verb the line names must exist
        named = [word for word in words[1:] if re.fullmatch(r"[a-z]+", word)]
        if not named or any(word not in verb.commands for word in named[:1]):
            return [f"{command}: no sub-verb {named[:1]} of {words[0]}"]
        if len(named) > 1 and "|" not in command:
            named = named[:1]  # later bare words are arguments (models fetch mpnet)
        wrong = [f"{command}: no sub-verb {word} of {words[0]}" for word in named if word not in verb.commands]
        if wrong:
            return wrong
        verb = verb.commands[named[0]]
    options = {option for parameter in verb.params for option in (*parameter.opts, *parameter.secondary_opts)}
    return [f"{command}: no option {option}" for option in OPTION.findall(" ".join(words[1:])) if option not in options]


def test_every_attnpat_command_the_docs_show_is_a_verb_with_those_options():
    """The README's commands (its code blocks and code spans) and the docs' code blocks name registered verbs and
    options their verbs take; a renamed option or verb fails here, not in a reader's terminal."""
    root = typer.main.get_command(app)
    wrong = [problem for doc in DOCUMENTS
             for command in command_lines(doc.read_text(encoding="utf-8"), inline=doc.name == "README.md")
             for problem in unknown_verbs_and_options(command, root)]
    assert wrong == []


def test_the_command_check_catches_an_unknown_verb_option_or_sub_verb():
    root = typer.main.get_command(app)
    assert unknown_verbs_and_options("attnpat classify --task sst2 --map-kind norm", root) == []
    assert unknown_verbs_and_options("attnpat annotate serve | push | stop", root) == []
    assert unknown_verbs_and_options("attnpat models fetch mpnet", root) == []
    assert unknown_verbs_and_options("attnpat classify --taks sst2", root) == ["attnpat classify --taks sst2: "
                                                                                 "no option --taks"]
    assert unknown_verbs_and_options("attnpat clasify --task sst2", root)
    assert unknown_verbs_and_options("attnpat annotate serve | pusj", root)
    assert command_lines("```bash\nattnpat info   # what runs\n```\nsee `a && attnpat x --y` and `attnpat z`",
                         inline=True) == ["attnpat info   ", "attnpat x --y", "attnpat z"]


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces made dashes."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", FENCED.sub("", markdown), re.M)}


def broken_links(doc: Path) -> list[str]:
    """The relative links of ``doc`` to a file that does not exist or to a heading its target lacks."""
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path) if path else doc
        if not linked.exists() or (anchor and anchor not in heading_anchors(linked.read_text(encoding="utf-8"))):
            wrong.append(target)
    return wrong


def test_every_link_of_the_docs_resolves_to_a_file_and_heading():
    assert {doc.name: found for doc in DOCUMENTS if (found := broken_links(doc))} == {}


def test_the_link_check_catches_a_missing_file_or_heading(tmp_path):
    (tmp_path / "other.md").write_text("# A panel of your own\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](other.md#a-panel-of-your-own) [gone](missing.md) [no heading](other.md#nothing) "
                   "[web](https://example.org/x)", encoding="utf-8")
    assert broken_links(doc) == ["missing.md", "other.md#nothing"]


def make_targets_named(text: str) -> set[str]:
    """The targets of the `make X` commands in a document's code blocks and code spans."""
    code = [line for block in FENCED.findall(text) for line in block.splitlines()]
    code += code_spans(text)
    return {target for line in code for target in re.findall(r"(?:^|\s)make ([\w-]+)", line)}


def test_every_make_target_the_docs_name_is_in_the_makefile():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), re.M))
    named = {target for doc in DOCUMENTS for target in make_targets_named(doc.read_text(encoding="utf-8"))}
    assert named >= {"demo", "test"} and named - targets == set()
    assert code_spans("``a `b` c`` and `d`") == ["a `b` c", "d"]
    assert make_targets_named("```bash\nmake demo   # all\n```\n`/usr/bin/time -v make pipeline`, we make no") == {
        "demo", "pipeline"}
