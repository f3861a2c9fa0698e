"""The sampler in a user's own trainer: paths that used to give wrong results silently.

Each test names the wrong result it rules out: a bad manifest row planned into some bucket,
the resume state of another plan accepted, `set_epoch` dropping a resume, a loss normaliser
indexed by the loop's count, dataset indices off by the excluded rows, ranks that planned
differently, padding batches that cannot be told apart.
"""

from __future__ import annotations

import pytest

# --- 5. ranks that planned differently ------------------------------------------------------

RANKS_SCRIPT = """
import sys
import torch.distributed as dist
from adaptiveload.data.mixtures import synthesize
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.sampler import PlanBatchSampler

dist.init_process_group("gloo")
rank = dist.get_rank()
manifest = synthesize("tiny-cpu", 183, seed=0)
if rank == 1 and sys.argv[1] == "reversed":  # this rank read the manifest in another order
    manifest = manifest.iloc[::-1].reset_index(drop=True)
budgets = Budgets(m_tok=4096, m_mem=6144, m_comp=4096**1.2, p=1.2)
sampler = PlanBatchSampler.from_manifest(manifest, "adaptiveload", budgets, 2, rank, seed=0,
                                         grid="tiny")
try:
    sampler.check_ranks()
    verdict = "same plan"
except ValueError as exc:
    verdict = f"refused: {exc}"
with open(f"rank{rank}.txt", "w") as out:  # one file per rank: no interleaved output
    out.write(f"{len(sampler)} steps\\n{verdict}\\n")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("order", ["same", "reversed"])
def test_check_ranks_catches_a_rank_that_read_another_row_order(order, tmp_path):
    """Same length, different epoch: before, 92 samples trained twice and 91 never, silently."""
    import subprocess
    import sys

    from training_setup import free_port

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), order],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps, verdicts = zip(*(
        (tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)
    ), strict=True)
    assert len(set(steps)) == 1  # the lengths agree either way
    if order == "same":
        assert verdicts == ("same plan", "same plan")
    else:
        assert all(v.startswith("refused: process") for v in verdicts), verdicts
        assert all("data_digest (other samples, or the same ones in another row order)" in v
                   for v in verdicts)
