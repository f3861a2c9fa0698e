"""Sequence parallelism of the packed model under torchrun with gloo (one launch per world
size runs every case of `sp_worker.py`): outputs and parameter gradients of d = 2 and of mixed
degrees {1, 1, 2}, {2, 2}, {4} in one step equal one process's over the same samples (fp32,
relative <= 1e-5, eager and the fused op's CPU reference; diffusers' model through PackedWan
too), and perturbing one sample leaves another's outputs and gradients unchanged bit for bit
on every rank."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT, SUPPORT
from training_setup import cli_env, free_port

TORCHRUN = Path(sys.executable).parent / "torchrun"
WORKER = SUPPORT / "sp_worker.py"
RTOL = 1e-5
# diffusers' model through PackedWan: the same cases where diffusers is installed
DIFFUSERS = ("diffusers",) if importlib.util.find_spec("diffusers") else ()
DIFFUSERS_2 = ("{2} diffusers", "{2} diffusers checkpointed") if DIFFUSERS else ()


def _torchrun(world: int, out: Path) -> dict:
    """Every case of `sp_worker.py` on `world` gloo processes: rank -> its results."""
    done = subprocess.run(
        [TORCHRUN, "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(WORKER), str(out)],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def _check(results: dict, cases: set[str]) -> None:
    for rank, report in results.items():
        assert set(report["cases"]) == cases, rank
        for case, got in report["cases"].items():
            where = f"rank {rank}, {case}"
            assert got["outputs"] <= RTOL, where
            assert got["grads_group"] <= RTOL, where  # summed over the SP group
            assert got["grads_world"] <= RTOL, where  # summed over the world, each batch once
            assert got["isolated"], where  # another sample's perturbation: bit for bit
        refused = report["refusals"]
        diffusers = any("diffusers" in case for case in report["cases"])
        assert all("\n" not in line for line in refused) and len(refused) == (
            3 if len(results) == 4 else 2) + diffusers


def test_torchrun_two_ranks_one_group_of_two(tmp_path):
    results = _torchrun(2, tmp_path)
    _check(results, {"{2} eager", "{2} fused", "{2} eager checkpointed", *DIFFUSERS_2})


def test_torchrun_four_ranks_mixed_degrees(tmp_path):
    results = _torchrun(4, tmp_path)
    _check(results, {f"{p} {impl}" for p in ("{1,1,2}", "{2,2}", "{4}")
                     for impl in ("eager", "fused", *DIFFUSERS)})
    for rank in (0, 1):  # a group of one runs the unsharded path itself
        for impl in ("eager", "fused"):
            assert results[rank]["cases"][f"{{1,1,2}} {impl}"]["bitwise_unsharded"]
