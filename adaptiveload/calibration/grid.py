"""The (B, S) grid a calibration times: which points (`build_grid`, rules in
docs/calibration.md), the micro-batches that measure memory up to the derived budgets
(`memory_points`), and the bucket shape that gives a point its S tokens (`latent_grid`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaptiveload.costmodel import CostModel
from adaptiveload.errors import UserError
from adaptiveload.tokens import FRAME_STEP, PIXEL_STEP

MAX_AXIS = 1024  # Wan's RoPE tables cover 1024 positions per axis
MIN_PASSES = 2  # a single pass cannot tell a point's spread, nor survive one burst of load


def latent_grid(tokens: int) -> tuple[int, int, int]:
    """A (T', H', W') token grid with T'*H'*W' = tokens: fewest frames, then the squarest frame."""
    for frames in range(1, tokens + 1):
        if tokens % frames:
            continue
        area = tokens // frames
        h = max(d for d in range(1, int(area**0.5) + 1) if area % d == 0)
        w = area // h
        if w <= 4 * h and w <= MAX_AXIS and frames <= MAX_AXIS:
            return frames, h, w
    raise UserError(f"tokens {tokens}: no latent grid with <= {MAX_AXIS} positions per axis")


def bucket_shape(tokens: int) -> tuple[int, int, int]:
    """(frames, height, width) in pixels of the bucket whose token grid is `latent_grid`."""
    f, h, w = latent_grid(tokens)
    return 1 + FRAME_STEP * (f - 1), PIXEL_STEP * h, PIXEL_STEP * w


def build_grid(
    batch_sizes: Sequence[int], tokens: Sequence[int], largest_bucket: int | None,
    max_batch_tokens: int | None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (B, S) points to time and the ones the batch-token cap dropped.

    Rules (docs/calibration.md): B = 1 at every token size, including the manifest's largest
    bucket (the reference bucket the budgets are built on must be measured, not extrapolated);
    every batch size at every listed token size; `max_batch_tokens` drops only B > 1 points.
    Smallest micro-batches first, so the warm-up pass finds the memory limit last.
    """
    sizes = sorted(set(tokens) | ({largest_bucket} if largest_bucket else set()))
    grid = [(1, s) for s in sizes]
    grid += [(b, s) for s in sorted(set(tokens)) for b in sorted(set(batch_sizes)) if b > 1]
    dropped = []
    if max_batch_tokens is not None:
        dropped = [(b, s) for b, s in grid if b > 1 and b * s > max_batch_tokens]
        grid = [point for point in grid if point not in dropped]
    return sorted(grid, key=lambda bs: (bs[0] * bs[1], bs[0])), dropped


def validate_grid(
    batch_sizes: Sequence[int], tokens: Sequence[int], repeats: int, warmup: int
) -> None:
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError(f"batch sizes {list(batch_sizes)}: expected integers >= 1")
    if len(set(tokens)) < 2 or min(tokens) < 1:
        raise UserError(
            f"tokens {list(tokens)}: expected at least 2 distinct token counts >= 1 "
            "(the quadratic term needs them)"
        )
    if repeats < MIN_PASSES:
        raise UserError(
            f"repeats {repeats}: expected >= {MIN_PASSES} passes (one pass records no spread "
            "and cannot survive a burst of load)"
        )
    if warmup < 0:
        raise UserError(f"warmup {warmup}: expected >= 0 steps per point")
    for s in tokens:
        latent_grid(int(s))


def memory_points(
    targets: Sequence[float], tokens: Sequence[int], measured_tokens: int, cost: CostModel
) -> list[tuple[int, int]]:
    """The (B, S) micro-batches that measure peak memory up to each of `targets` (tokens per
    micro-batch: the derived M_mem and the largest pack the plans form) beyond the
    `measured_tokens` the grid reached. Each holds at least its target's tokens, B = ceil(T / S),
    at the grid token size S that `cost` (the first fit) predicts the fastest: memory depends on
    B·S and B alone, so a cheap shape measures it as well as a slow one, and many small
    samples are the case M_mem is derived for (their per-sample memory binds). Without these
    points M_mem and the largest packs rest on a linear fit of memory extrapolated past every
    point it was fitted to (docs/calibration.md). Smallest first."""
    sizes = np.array(sorted(set(tokens)), dtype=np.int64)
    points = set()
    for target in targets:
        if target <= measured_tokens:
            continue
        batch = -(-int(np.ceil(target)) // sizes)
        best = int(np.argmin(cost.step_time(batch, sizes)))
        points.add((int(batch[best]), int(sizes[best])))
    return sorted(points, key=lambda bs: (bs[0] * bs[1], bs[0]))
