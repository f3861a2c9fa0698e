"""Functions a newcomer can read: none in the package runs over 80 lines or takes more than 12
parameters. A CLI command counts whole, its option declarations with its body, and is held to
60 lines: options shared by commands are declared once (`cli/options.py`), what a command
plans or measures is built as one config object, and the logic lives in the package."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import adaptiveload

PACKAGE = Path(adaptiveload.__file__).resolve().parent
REPO = PACKAGE.parent
# where a name of the package may be used: its code, tests, docs, pipeline and experiments
USES = (
    "adaptiveload/**/*.py",
    "tests/**/*.py",
    "docs/**/*.md",
    "workflow/**/*.smk",
    "experiments/**/*.py",
    "Snakefile",
)
MAX_LINES = 80
MAX_PARAMS = 12
MAX_COMMAND_LINES = 60  # a command's options and body


def _is_command(node: ast.FunctionDef) -> bool:
    """A typer command: decorated with `<app>.command(...)`."""
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
        for d in node.decorator_list
    )


def too_big(source: str) -> list[str]:
    """`name: what` for every function of `source` over the limits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        command = _is_command(node)
        lines = node.end_lineno - node.lineno + 1
        a = node.args
        params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
        params += (a.vararg is not None) + (a.kwarg is not None)
        if lines > (MAX_COMMAND_LINES if command else MAX_LINES):
            found.append(f"{node.name}: {lines} lines{' (a command)' if command else ''}")
        if params > MAX_PARAMS and not command:
            found.append(f"{node.name}: {params} parameters")
    return found


def test_no_function_is_too_long_or_takes_too_many_parameters():
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for what in too_big(path.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_a_long_function_and_counts_a_commands_options():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    params = ", ".join(f"p{i}" for i in range(MAX_PARAMS + 1))
    assert too_big(f"def f():\n{long_body}\n") == [f"f: {MAX_LINES + 1} lines"]
    assert too_big(f"def g({params}):\n    pass\n") == [f"g: {MAX_PARAMS + 1} parameters"]
    # a command may take many options (no parameter limit), but they count as its lines
    options = "\n".join(f"    p{i}: int = 0," for i in range(MAX_COMMAND_LINES - 3))
    command = f"@app.command('c')\ndef c(\n{options}\n) -> None:\n    pass\n"
    assert too_big(command) == []
    longer = command.replace("    pass\n", "    x = 1\n    pass\n")
    assert too_big(longer) == [f"c: {MAX_COMMAND_LINES + 1} lines (a command)"]


def defined_names(source: str) -> list[str]:
    """The module-level functions, classes and constants of `source` (CLI commands aside:
    typer calls them)."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            if not (isinstance(node, ast.FunctionDef) and _is_command(node)):
                names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("__")]


def test_no_module_level_name_is_unused():
    """A name defined once and never read, in the package or by its tests, docs or pipeline,
    is dead code (or a duplicate of the literal used instead)."""
    texts = {p: p.read_text() for pattern in USES for p in REPO.glob(pattern) if p.is_file()}
    words = Counter(w for text in texts.values() for w in re.findall(r"\w+", text))
    unused = [
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in defined_names(texts[path])
        if words[name] <= 1
    ]
    assert not unused, "\n".join(unused)


def test_the_unused_name_check_sees_definitions_and_skips_commands():
    source = "X = 1\nclass C: ...\ndef f(): ...\n@app.command('c')\ndef c(): ...\n"
    assert defined_names(source) == ["X", "C", "f"]


def test_no_formatter_markers():
    """No formatter runs on this tree (`make check` is ruff's linter), so a `fmt: skip` or
    `fmt: off` comment would promise something nothing keeps: none in the code."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off|on)\b")
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for pattern in USES
        if not pattern.startswith("docs")
        for path in REPO.glob(pattern)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker.search(line)
    ]
    assert not found, found
