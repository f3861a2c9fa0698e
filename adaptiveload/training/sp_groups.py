"""The sequence-parallel (SP) process groups of a run, built once at start.

A sample split over `d` ranks runs its Ulysses all-to-all inside one SP group of degree `d`.
The groups of degree `d` are the ALIGNED BLOCKS of ranks [k·d, (k+1)·d), k = 0 .. N/d - 1,
with `d` a power of two dividing the world size N:

- a bounded number of groups: N/d per degree, at most N/2 + N/4 + ... + 1 = N - 1 over all
  degrees of a world, where groups at any offset would be N - d + 1 per degree (and each
  one is a communicator NCCL sets up and holds memory for);
- blocks of powers of two nest (a block of degree 2d is two blocks of degree d), so a step
  can mix degrees and still tile the world: a planner places a sample of degree `d` at a
  rank offset that is a multiple of `d`, and the samples of one step cover disjoint blocks;
- on a node of 8 GPUs (and at any power-of-two node size) a block of degree <= 8 never
  straddles the node boundary, so its all-to-all stays on NVLink.

`torch.distributed.new_group` is collective over the whole world: every rank calls it for
every group, members or not, in the same order. `SPGroups.build` does so for every
(degree, offset) in one fixed order (degrees ascending, offsets ascending) on every rank, so
the groups are the same on every rank without any communication about which ones exist.
Degree 1 needs no group: such a sample runs on its rank alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from adaptiveload.errors import UserError


def check_group_degree(degree: int, world_size: int) -> int:
    """`degree`, if it is a power of two dividing `world_size`; else a one-line UserError."""
    if degree < 1 or degree & (degree - 1) or world_size % degree:
        raise UserError(
            f"sequence-parallel degree {degree}: expected a power of two dividing the world "
            f"size {world_size} (its groups are aligned blocks of ranks)"
        )
    return degree


def degrees_of(world_size: int) -> tuple[int, ...]:
    """Every SP degree > 1 a world of `world_size` ranks can hold: 2, 4, ... dividing it."""
    out, d = [], 2
    while d <= world_size and world_size % d == 0:
        out.append(d)
        d *= 2
    return tuple(out)


def block(rank: int, degree: int) -> range:
    """The ranks of the aligned block of `degree` that holds `rank`."""
    start = rank // degree * degree
    return range(start, start + degree)


def blocks(world_size: int, degree: int) -> list[range]:
    """The groups of `degree` of a world: its aligned blocks, by offset."""
    check_group_degree(degree, world_size)
    return [range(k, k + degree) for k in range(0, world_size, degree)]


@dataclass(frozen=True)
class SPGroups:
    """This process's view of the run's SP groups: for every degree > 1 the plan uses, the
    process group of every aligned block (`torch.distributed.new_group`'s handle; on a rank
    outside a block that handle is torch's non-member marker and must not be used)."""

    world_size: int
    degrees: tuple[int, ...]
    handles: dict[tuple[int, int], Any] = field(repr=False)  # (degree, offset) -> group

    @classmethod
    def build(cls, world_size: int, degrees: Iterable[int]) -> SPGroups:
        """The groups of every degree in `degrees` (1 and repeats ignored); call it on every
        rank of an initialised world, with the same degrees (they are the plan's, the same
        on every rank). Degrees are checked before any group is made."""
        import torch.distributed as dist

        wanted = sorted({check_group_degree(int(d), world_size) for d in degrees} - {1})
        handles = {
            (d, b.start): dist.new_group(list(b)) for d in wanted for b in blocks(world_size, d)
        }
        return cls(world_size, tuple(wanted), handles)

    def group_of(self, rank: int, degree: int) -> tuple[Any, int]:
        """(process group, rank within it) of `rank`'s block of `degree`; degree 1: (None, 0).

        The group is usable on the processes of its block only: ask for this process's own
        rank."""
        if degree == 1:
            return None, 0
        if degree not in self.degrees:
            raise UserError(
                f"sequence-parallel degree {degree}: no group was built for it (built: "
                f"{', '.join(map(str, self.degrees)) or 'none'}); give the run's degrees to "
                "SPGroups.build at start"
            )
        if not 0 <= rank < self.world_size:
            raise UserError(f"rank {rank}: expected 0 <= rank < {self.world_size}")
        members = block(rank, degree)
        return self.handles[(degree, members.start)], rank - members.start
