"""`calibrate comm` for real: one torchrun of 4 gloo processes measures all-to-all into a
calibration's `comm` section, and the SP process groups are the aligned blocks. Nothing here
asserts a timing value."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from comm_format import SPEC_KEYS
from repo_paths import H200_PRIOR, ROOT, SUPPORT
from training_setup import cli_env, free_port

from adaptiveload.training.sp_groups import block

TORCHRUN = Path(sys.executable).parent / "torchrun"


def test_torchrun_calibrate_comm_writes_its_section_and_groups_are_aligned_blocks(tmp_path):
    """One torchrun of 4 gloo processes: `calibrate comm` for real (sizes spanning 4 KiB to
    16 MiB so the largest is transfer-bound even on a loaded CPU), then the SP groups."""
    cal, out = tmp_path / "cal.json", tmp_path / "with-comm.json"
    cal.write_text(H200_PRIOR.read_text())
    sizes = (4096, 2**20, 2**24)
    proc = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(SUPPORT / "sp_comm_check.py"),
         str(tmp_path), "calibrate", "comm", "--calibration", str(cal), "--out", str(out),
         "--sizes", ",".join(map(str, sizes)), "--repeats", "3", "--warmup", "1"],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = json.loads(cal.read_text()), json.loads(out.read_text())
    assert {k: v for k, v in after.items() if k != "comm"} == before  # the rest untouched
    comm = after["comm"]
    assert set(comm) >= SPEC_KEYS and comm["backend"] == "gloo"
    assert comm["source"] == "measured" and comm["provenance"]["world_size"] == 4
    assert [link["degree"] for link in comm["links"]] == [2, 4]
    assert all(link["latency_s"] >= 0 and link["bytes_per_s"] > 0 for link in comm["links"])
    assert all(math.isfinite(link["bytes_per_s"]) for link in comm["links"])
    measured = {(p["degree"], p["bytes"]) for p in comm["points"] if p["seconds"] > 0}
    assert measured == {(d, n) for d in (2, 4) for n in sizes}
    assert proc.stderr.count("comm: degree") == 6  # progress lines, rank 0 only
    assert f"{out}: comm measured" in proc.stderr

    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for rank, view in seen.items():
        assert view["built"]["degrees"] == [2, 4]
        assert view["1"] == {"group": None, "rank_in_group": 0}
        for degree in (2, 4):
            mine = view[str(degree)]
            assert mine["members"] == list(block(rank, degree))
            assert mine["rank_in_group"] == mine["torch_rank_in_group"] == rank % degree
            assert mine["sum_of_ranks"] == sum(block(rank, degree))
    for degree in (2, 4):  # every rank in exactly one group of each degree
        groups = {tuple(view[str(degree)]["members"]) for view in seen.values()}
        assert sorted(r for g in groups for r in g) == [0, 1, 2, 3]
