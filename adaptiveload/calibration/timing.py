"""Timing the model: synchronised forward+backward steps of one micro-batch (a dense bucket
batch or a packed one), a process warm-up, and the passes over a grid whose minimum is a
point's time (docs/calibration.md)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from adaptiveload.calibration.grid import bucket_shape, latent_grid
from adaptiveload.calibration.settings import Grid, Pack
from adaptiveload.data.packed import collate
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
    """One forward+backward; bf16 autocast on CUDA as in Wan training, fp32 on CPU.

    `batch` is `random_batch`'s dense (x, t, context, target) or `random_pack`'s packed one
    (x and target lists of shape groups): the loss is the mean squared error over all of its
    elements either way, so a pack and a grid point run the same step."""
    x, t, context, target = batch
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        pred = model(x, t, context)
        if isinstance(pred, torch.Tensor):
            loss = torch.nn.functional.mse_loss(pred, target)
        else:
            squared = [(p - y).pow(2).sum() for p, y in zip(pred, target, strict=True)]
            loss = torch.stack(squared).sum() / sum(y.numel() for y in target)
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


def random_pack(cfg: WanConfig, tokens: Sequence[int], device: torch.device, seed: int) -> tuple:
    """One packed micro-batch of samples of `tokens` S_i tokens, laid out as training
    collates it (`data.packed.collate`: one dense group per latent shape, longest first),
    each sample the bucket shape of its S_i (`latent_grid`, as a grid point's); random
    timesteps, text contexts and regression targets, like `random_batch`."""
    pt, ph, pw = cfg.patch_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    items = []
    for i, s in enumerate(tokens):
        f, h, w = latent_grid(int(s))
        items.append({
            "sample_id": str(i),
            "latent": torch.randn(cfg.in_dim, f * pt, h * ph, w * pw, generator=gen),
            "context": torch.randn(cfg.text_len, cfg.text_dim, generator=gen),
        })
    batch = collate(items)
    t = torch.rand(batch.num_samples, generator=gen) * 1000
    x = [g.to(device) for g in batch.latents]
    return x, t.to(device), batch.context.to(device), [torch.randn_like(g) for g in x]


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


def _drop_oom(model: WanModel, point: dict, inputs: dict, key: int) -> None:
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
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time every (B, S) point of `grid` and every pack of `passes.packs` (one packed
    micro-batch each, `random_pack`): `passes.warmup` steps each, then `passes.repeats` passes
    over all of them (`passes`: the calibration's grid settings); returns (points, packs).

    Passes (rather than back-to-back repeats) spread bursts of contention on a shared machine
    over all points instead of ruining one; the packs share the passes, so they are timed under
    the same conditions as the points they are predicted from. A point's `time_s` is the
    minimum over passes of the `timer` seconds: interference (another process, a GC pause, a
    host hiccup) only ever adds time, so the minimum is the least contaminated estimate of
    what the step costs; the median and the spread ((max - min) / min over passes) are kept
    beside it. Fast points run several steps per pass (at least `min_seconds`) so timer and
    launch jitter average out. Both wall and thread-CPU seconds are kept. Peak memory (CUDA)
    is the max over passes, reset before every measurement. Smallest micro-batches (by
    tokens) are warmed up first, so the warm-up pass finds the memory limit last.
    """
    cfg = model.cfg
    points = [_point_record(b, s) for b, s in grid]
    packs = [_pack_record(pack) for pack in passes.packs]
    builders = [partial(random_batch, cfg, b, s, device, seed) for b, s in grid]
    builders += [partial(random_pack, cfg, pack.tokens, device, seed) for pack in passes.packs]
    records = points + packs
    order = sorted(range(len(records)), key=lambda i: _total_tokens(records[i]))
    iters = _time_passes(model, [(records[i], builders[i]) for i in order], device, passes,
                         min_seconds, progress)
    for record, steps in zip((records[i] for i in order), iters, strict=True):
        for name in ("wall_s", "cpu_s"):
            samples = record.pop(name)
            record[f"{name}_passes"] = samples
            record[name] = min(samples) if samples else None
            record[f"{name}_median"] = statistics.median(samples) if samples else None
        record["steps_per_pass"] = steps
        record["time_s"] = record[f"{timer}_s"]
        record["spread"] = pass_spread(record[f"{timer}_s_passes"])
    return points, packs


def _point_record(batch: int, tokens: int) -> dict[str, Any]:
    frames, height, width = bucket_shape(tokens)
    return {
        "batch": batch, "tokens": tokens, "frames": frames, "height": height, "width": width,
        "wall_s": [], "cpu_s": [], "peak_bytes": None, "status": "ok",
    }


def _pack_record(pack: Pack) -> dict[str, Any]:
    return {
        "pack": pack.name, "tokens": list(pack.tokens), "samples": len(pack.tokens),
        "sum_tokens": sum(pack.tokens), "latent_grids": [list(latent_grid(s)) for s in pack.tokens],
        "wall_s": [], "cpu_s": [], "peak_bytes": None, "status": "ok",
    }


def _total_tokens(record: dict[str, Any]) -> tuple[int, int]:
    """The tokens of a point's or a pack's micro-batch, then its samples (the order of work)."""
    if "pack" in record:
        return record["sum_tokens"], record["samples"]
    return record["batch"] * record["tokens"], record["batch"]


def _time_passes(
    model: WanModel, jobs: list[tuple[dict[str, Any], Callable[[], tuple]]],
    device: torch.device, passes: Grid, min_seconds: float, progress: bool,
) -> list[int | None]:
    """The timing loop of `measure_grid` over (record, inputs builder) jobs, in their order:
    a warm-up pass that builds each input and finds what fits, then the timed passes, each
    appending its seconds (and peak memory on CUDA) to the job's record. Returns each job's
    steps per pass (None: out of memory).

    A job's steps per pass come from the last warm-up step's time; a fast one (under
    `min_seconds`, or without warm-up) gets one more step to size them on. A slow job needs
    no such probe (it runs one step per pass whatever the probe says): on an H200 that step
    was a quarter of the grid's device time."""
    repeats = passes.repeats
    inputs: dict[int, tuple] = {}
    iters: dict[int, int] = {}
    with progress_bar(total=len(jobs) * (1 + repeats), desc="calibrate",
                      disable=not progress) as bar:
        for key, (record, build) in enumerate(jobs):  # warm-up pass; finds what fits
            try:
                inputs[key] = build()
                probe = None
                for _ in range(passes.warmup):
                    probe, _ = timed(model, inputs[key], device, 1)
                if probe is None or probe < min_seconds:  # size a fast point on a warm step
                    probe, _ = timed(model, inputs[key], device, 1)
            except torch.OutOfMemoryError:
                _drop_oom(model, record, inputs, key)
                bar.update(1 + repeats)
                continue
            iters[key] = max(1, min(20, int(np.ceil(min_seconds / max(probe, 1e-6)))))
            bar.update(1)
        for _ in range(repeats):
            for key in list(inputs):
                record = jobs[key][0]
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    wall, cpu = timed(model, inputs[key], device, iters[key])
                except torch.OutOfMemoryError:  # fragmentation can bite after warm-up too
                    _drop_oom(model, record, inputs, key)
                    bar.update(1)
                    continue
                record["wall_s"].append(wall)
                record["cpu_s"].append(cpu)
                if device.type == "cuda":
                    peak = float(torch.cuda.max_memory_allocated(device))
                    record["peak_bytes"] = max(record["peak_bytes"] or 0.0, peak)
                bar.update(1)
    return [iters.get(key) for key in range(len(jobs))]


def pass_spread(passes: Sequence[float]) -> float | None:
    """(max - min) / min over a point's passes: how much one pass can be off."""
    return (max(passes) - min(passes)) / min(passes) if passes else None
