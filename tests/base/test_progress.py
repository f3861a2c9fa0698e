"""Progress in a log file is plain lines; on a terminal it stays a tqdm bar."""

from __future__ import annotations

import io
import subprocess
import sys

from adaptiveload.progress import LogLines, progress_bar


def test_log_file_gets_whole_lines_first_and_last(tmp_path):
    log = tmp_path / "job.log"
    code = (
        "from adaptiveload.progress import progress_bar\n"
        "bar = progress_bar(total=5, desc='train run', interval_s=3600)\n"
        "for i in range(5):\n"
        "    bar.update(1)\n"
        "    bar.set_postfix(loss=f'{1 / (i + 1):.2f}', refresh=False)\n"
        "bar.close()\n"
    )
    with log.open("w") as err:  # stderr is a file, as under Snakemake or SLURM
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True)
    text = log.read_bytes().decode()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # the interval is an hour: only the first line (0/5) and the final count
    assert len(lines) == 2, lines
    assert lines[0].startswith("train run: 0/5 (0%)")
    assert lines[1].startswith("train run: 5/5 (100%)") and "loss=0.20" in lines[1]


def test_every_update_past_the_interval_prints_a_line():
    out = io.StringIO()  # not a TTY
    bar = progress_bar(iterable=range(3), desc="figures", file=out, interval_s=0)
    assert isinstance(bar, LogLines)
    assert list(bar) == [0, 1, 2]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("figures: 0/3") and lines[-1].startswith("figures: 3/3")
    assert len(set(lines)) == len(lines)  # the final count is not repeated


def test_disabled_prints_nothing():
    out = io.StringIO()
    with progress_bar(total=3, desc="x", file=out, disable=True) as bar:
        bar.update(3)
    assert out.getvalue() == ""
