import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from adaptiveload.cli import main; main()", *args],
        capture_output=True,
        text=True,
    )


def test_help_lists_stages():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    assert "adaptiveload" in out.stdout or "Usage" in out.stdout
