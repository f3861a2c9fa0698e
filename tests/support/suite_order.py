"""The suite's own scheduling: the longest test files start first (tests/conftest.py applies
it to every collected test)."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from repo_paths import TESTS

# The test files that take longest, longest first (each over ~50 s in a 2-process run on the
# 2-core machine), as paths under tests/. They are collected first, and `make test` hands whole
# files to its pytest processes in collection order (--dist loadfile --no-loadscope-reorder),
# so the run ends on short files instead of one process running the pipeline test alone while
# the other idles: longest-processing-time-first, as the planner deals its packs. Other files
# follow in their usual order; the order of tests inside a file never changes.
LONGEST_FIRST = (
    "slow/repo/test_pipeline.py", "slow/cli/test_faults_slow.py",
    "slow/repo/test_gpu_check_slow.py", "slow/repo/test_install.py",
    "slow/tracking/test_tracking_slow.py", "slow/training/test_run_state.py",
    "slow/calibration/test_calibration_slow.py", "slow/training/test_train_packed_slow.py",
    "slow/repo/test_routes_slow.py", "slow/planning/test_sampler_docs_slow.py",
    "slow/training/test_train_distributed_slow.py", "planning/test_packing.py",
    "slow/training/test_sp_train_slow.py", "slow/model/test_sp_model_slow.py",
    "ops/test_kernel_ops.py",
    "slow/ops/test_kernel_build.py", "slow/training/test_train_resume.py",
    "slow/repo/test_kernel_check.py", "ops/test_kernel_segments.py",
)


def longest_first(items: list[Any]) -> None:
    """Sort pytest's `items` in place: LONGEST_FIRST's files first, in its order; a stable
    sort, so nothing else moves."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: Any) -> int:
        path = PurePath(item.path)
        if TESTS not in path.parents:
            return len(rank)
        return rank.get(path.relative_to(TESTS).as_posix(), len(rank))

    items.sort(key=key)


# what only the slow lane starts (tests/slow/): the pipeline, torchrun, an MLflow server, an
# install; a test outside tests/slow/ that starts one fails (tests/conftest.py)
END_TO_END = ("snakemake", "torchrun", "torch.distributed.run", "mlflow", "pip", "venv")


def end_to_end(args: Any) -> str | None:
    """The END_TO_END program an argv (or a shell command line) starts, as a program or as
    `python -m <module>`; None for anything else."""
    argv = args.split() if isinstance(args, str) else [str(a) for a in args]
    words = [PurePath(argv[0]).name] if argv else []
    words += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"]
    return next((w for w in words if w in END_TO_END), None)
