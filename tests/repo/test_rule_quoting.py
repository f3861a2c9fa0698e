"""No value from an experiment file reaches a job's shell unquoted: every placeholder of every
rule's `shell:` command carries Snakemake's `:q` (a list is quoted item by item), so a path
with a space or a `$(...)` is one word, never code. `{threads}` is Snakemake's own integer."""

from __future__ import annotations

import re

from repo_paths import ROOT

SHELL = re.compile(r"^( +)shell:\n((?:\1 +\"[^\n]*\"\n)+)", re.M)
PLACEHOLDER = re.compile(r"(?<!\{)\{([^{}]+)\}(?!\})")
OWN = {"threads"}  # Snakemake's own values, never from a config


def _shell_commands() -> dict[str, str]:
    commands = {}
    for path in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for i, match in enumerate(SHELL.finditer(path.read_text())):
            text = "".join(re.findall(r"\"([^\n]*)\"", match.group(2)))
            commands[f"{path.name}#{i}"] = text
    return commands


def test_every_shell_placeholder_is_quoted():
    commands = _shell_commands()
    assert len(commands) >= 15, "the rules' shell commands were not found"
    unquoted = {name: field for name, text in commands.items()
                for field in PLACEHOLDER.findall(text)
                if field not in OWN and not field.endswith(":q")}
    assert not unquoted, f"quote these with :q (a flag list: a list param): {unquoted}"
