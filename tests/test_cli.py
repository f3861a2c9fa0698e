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
