import subprocess
import sys

from adaptiveload.cli import STAGES


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from adaptiveload.cli import main; main()", *args],
        capture_output=True,
        text=True,
    )


def test_help_lists_stages():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    # first word of each help line, box-drawing stripped: the registered command names
    listed = {line.strip("│ ").split(" ", 1)[0] for line in out.stdout.splitlines()}
    assert set(STAGES) <= listed, out.stdout


def _commands():
    """(path, click command) of every leaf command of the `adaptiveload` app."""
    import typer

    from adaptiveload.cli import _register
    from adaptiveload.cli.app import app

    _register()
    todo = [((), typer.main.get_command(app))]
    while todo:
        path, cmd = todo.pop()
        subs = getattr(cmd, "commands", None)
        if subs:
            todo += [((*path, name), sub) for name, sub in subs.items()]
        else:
            yield path, cmd


def test_version_flag():
    from adaptiveload import __version__

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"adaptiveload {__version__}"


def test_every_command_has_examples_that_use_its_real_options():
    import shlex

    seen = 0
    for path, cmd in _commands():
        assert cmd.epilog and cmd.epilog.startswith("Examples:"), path
        flags = {o for p in cmd.params for o in p.opts}
        lines = [ln.strip()[2:] for ln in cmd.epilog.splitlines() if ln.strip().startswith("$ ")]
        assert lines, path
        for line in lines:
            words = shlex.split(line)
            start = words.index("adaptiveload") + 1 if "adaptiveload" in words else 0
            assert tuple(words[start : start + len(path)]) == path, (path, line)
            used = {w.split("=")[0] for w in words[start + len(path) :] if w.startswith("-")}
            assert used <= flags, (path, used - flags)
            seen += 1
    assert seen >= 20


def test_help_is_plain_text_at_any_width():
    import os

    env = dict(os.environ, COLUMNS="60")
    out = subprocess.run(
        [sys.executable, "-m", "adaptiveload", "train", "--help"],
        capture_output=True, text=True, env=env,
    )
    assert out.returncode == 0
    assert "│" not in out.stdout and "Examples:" in out.stdout
    prose = out.stdout.split("Options:")[0]
    assert all(len(line) <= 60 for line in prose.splitlines())  # rewrapped, not hard-wrapped
