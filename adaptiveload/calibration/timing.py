"""Timing the model: synchronised forward+backward steps of one micro-batch, a process
warm-up, and the passes over a grid whose minimum is a point's time (docs/calibration.md)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from adaptiveload.calibration.grid import bucket_shape, latent_grid
from adaptiveload.calibration.settings import Grid
from adaptiveload.model.architectures import WanConfig
from adaptiveload.model.wan import WanModel
from adaptiveload.progress import progress_bar

PROCESS_WARMUP_STEPS = 3  # whole-model steps before the first point (allocator, handles, code)
TIMING = (
    "forward+backward of one micro-batch, synchronised; a process warm-up of the whole model, "
    "then per point `warmup` steps; a point's time is the MINIMUM over `repeats` passes of the "
    "whole grid (fast points: the mean of several steps per pass); median and spread kept"
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: WanModel, batch: tuple, device: torch.device) -> None:
    """One forward+backward; bf16 autocast on CUDA as in Wan training, fp32 on CPU."""
    x, t, context, target = batch
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = torch.nn.functional.mse_loss(model(x, t, context), target)
    loss.backward()
    model.zero_grad(set_to_none=True)


def random_batch(cfg: WanConfig, batch: int, tokens: int, device: torch.device, seed: int) -> tuple:
    """Random latents of the bucket shape, timesteps, text context and a regression target."""
    f, h, w = latent_grid(tokens)
    pt, ph, pw = cfg.patch_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, cfg.in_dim, f * pt, h * ph, w * pw, generator=gen)
    t = torch.rand(batch, generator=gen) * 1000
    context = torch.randn(batch, cfg.text_len, cfg.text_dim, generator=gen)
    return tuple(v.to(device) for v in (x, t, context, torch.randn_like(x)))


def timed(model: WanModel, inputs: tuple, device: torch.device, iters: int) -> tuple[float, float]:
    """Mean (wall, thread CPU) seconds of `iters` synchronised forward+backward steps.

    Thread CPU time is the calling thread's work only: with one torch thread (CPU backward runs
    on the calling thread) it is the step's work without the time spent waiting for a core,
    which is what a loaded machine adds to wall time.
    """
    _sync(device)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        train_step(model, inputs, device)
    _sync(device)
    return (time.perf_counter() - wall) / iters, (time.thread_time() - cpu) / iters


def _drop_oom(model: WanModel, point: dict, inputs: dict, key: tuple[int, int]) -> None:
    """Mark a point out-of-memory and release what the failed step held."""
    point["status"] = "oom"
    point["wall_s"], point["cpu_s"] = [], []
    inputs.pop(key, None)
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_up_process(
    model: WanModel, shape: tuple[int, int], device: torch.device, steps: int, seed: int = 0
) -> float:
    """Run `steps` whole-model steps before anything is timed; returns their seconds.

    A cold process pays for allocator growth, library handles and first calls of every code
    path: on an H200 the first points of a cold process were ~45% slower than the same points
    minutes later. One shape (the grid's smallest) suffices; per-shape effects are the
    per-point warm-up's job.
    """
    inputs = random_batch(model.cfg, shape[0], shape[1], device, seed)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, inputs, device)
    _sync(device)
    return time.perf_counter() - start


def measure_grid(
    model: WanModel, grid: Sequence[tuple[int, int]], device: torch.device, passes: Grid,
    seed: int = 0, min_seconds: float = 0.05, progress: bool = True, timer: str = "wall",
) -> list[dict[str, Any]]:  # fmt: skip
    """Time every (B, S) point: `passes.warmup` steps each, then `passes.repeats` passes over
    the whole grid (`passes`: the calibration's grid settings, whatever the points are).

    Passes (rather than back-to-back repeats) spread bursts of contention on a shared machine
    over all points instead of ruining one. A point's `time_s` is the minimum over passes of
    the `timer` seconds: interference (another process, a GC pause, a host hiccup) only ever
    adds time, so the minimum is the least contaminated estimate of what the step costs; the
    median and the spread ((max - min) / min over passes) are kept beside it. Fast points run
    several steps per pass (at least `min_seconds`) so timer and launch jitter average out.
    Both wall and thread-CPU seconds are kept. Peak memory (CUDA) is the max over passes,
    reset before every measurement.
    """
    repeats, warmup = passes.repeats, passes.warmup
    points: dict[tuple[int, int], dict[str, Any]] = {}
    inputs: dict[tuple[int, int], tuple] = {}
    iters: dict[tuple[int, int], int] = {}
    total = len(grid) * (1 + repeats)
    with progress_bar(total=total, desc="calibrate", disable=not progress) as bar:
        for b, s in grid:  # warm-up pass, in grid order; finds what fits
            frames, height, width = bucket_shape(s)
            points[b, s] = {
                "batch": b, "tokens": s, "frames": frames, "height": height, "width": width,
                "wall_s": [], "cpu_s": [], "peak_bytes": None, "status": "ok",
            }  # fmt: skip
            try:
                inputs[b, s] = random_batch(model.cfg, b, s, device, seed)
                for _ in range(warmup):
                    train_step(model, inputs[b, s], device)
                probe, _ = timed(model, inputs[b, s], device, 1)
            except torch.OutOfMemoryError:
                _drop_oom(model, points[b, s], inputs, (b, s))
                bar.update(1 + repeats)
                continue
            iters[b, s] = max(1, min(20, int(np.ceil(min_seconds / max(probe, 1e-6)))))
            bar.update(1)
        for _ in range(repeats):
            for key in list(inputs):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    wall, cpu = timed(model, inputs[key], device, iters[key])
                except torch.OutOfMemoryError:  # fragmentation can bite after warm-up too
                    _drop_oom(model, points[key], inputs, key)
                    bar.update(1)
                    continue
                points[key]["wall_s"].append(wall)
                points[key]["cpu_s"].append(cpu)
                if device.type == "cuda":
                    peak = float(torch.cuda.max_memory_allocated(device))
                    points[key]["peak_bytes"] = max(points[key]["peak_bytes"] or 0.0, peak)
                bar.update(1)
    for key, point in points.items():
        for name in ("wall_s", "cpu_s"):
            samples = point.pop(name)
            point[f"{name}_passes"] = samples
            point[name] = min(samples) if samples else None
            point[f"{name}_median"] = statistics.median(samples) if samples else None
        point["steps_per_pass"] = iters.get(key)
        point["time_s"] = point[f"{timer}_s"]
        point["spread"] = pass_spread(point[f"{timer}_s_passes"])
    return list(points.values())


def pass_spread(passes: Sequence[float]) -> float | None:
    """(max - min) / min over a point's passes: how much one pass can be off."""
    return (max(passes) - min(passes)) / min(passes) if passes else None
