"""Run under torchrun (gloo): the SP groups of degrees 1, 2 and 4 (and 4 again), whose view
from each rank goes to OUT/rank<r>.json (the members and this rank's rank in its group of
every degree, torch's own view of the group, and the sum of the group's world ranks
all-reduced inside it: the group carries traffic, among its members only); then, in the same
world, `adaptiveload ARGS...` through the console entry point as `-m adaptiveload` runs it
(`calibrate comm`, which finds the process group started and ends it).

    torchrun --nproc-per-node 4 tests/support/sp_comm_check.py OUT calibrate comm --calibration ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from adaptiveload.cli import main as cli_main
from adaptiveload.training.sp_groups import SPGroups


def groups_seen(world: int, rank: int) -> dict[str, dict]:
    """What `rank` sees of the groups `SPGroups.build` makes for degrees 1, 4, 2, 4."""
    groups = SPGroups.build(world, [1, 4, 2, 4])
    seen: dict[str, dict] = {"built": {"degrees": list(groups.degrees)}}
    for degree in groups.degrees:
        group, in_group = groups.group_of(rank, degree)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        seen[str(degree)] = {
            "members": dist.get_process_group_ranks(group),
            "rank_in_group": in_group,
            "torch_rank_in_group": dist.get_rank(group),
            "sum_of_ranks": total.item(),
        }
    group, in_group = groups.group_of(rank, 1)
    seen["1"] = {"group": group, "rank_in_group": in_group}
    return seen


def main(out: Path, cli_args: list[str]) -> None:
    dist.init_process_group("gloo")  # one per process: torchrun's store holds one world
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(groups_seen(dist.get_world_size(), rank)))
    sys.argv = ["adaptiveload", *cli_args]
    try:
        cli_main()
    except SystemExit as exc:  # click ends a command that succeeded with exit status 0
        if exc.code not in (0, None):
            raise
    assert not dist.is_initialized(), "the command ends the process group"


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
