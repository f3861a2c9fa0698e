"""Functions a newcomer can read: none in the package runs over 80 lines or takes more than 12
parameters. A CLI command counts whole, its option declarations with its body, and is held to
60 lines: options shared by commands are declared once (`cli/options.py`), what a command
plans or measures is built as one config object, and the logic lives in the package."""

from __future__ import annotations

import ast
from pathlib import Path

import adaptiveload

PACKAGE = Path(adaptiveload.__file__).resolve().parent
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
