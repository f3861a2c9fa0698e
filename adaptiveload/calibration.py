"""Measure how a Wan model's training step grows with B and S on this device; derive budgets.

`calibrate` times forward+backward micro-batches over a (B, S) grid of bucket shapes
(`build_grid`: B = 1 at every size and at the manifest's largest bucket; a process warm-up,
per-point warm-up, then the minimum over >= 2 passes, spread recorded), records peak memory
where the device can report it (CUDA), fits the floored cost model with its degeneracy checks
(`costmodel.fit_measured`) and derives p, M_mem, M_comp and the equal-token baseline's M_tok for
a manifest (`costmodel.BUDGET_RULES`). On CPU there is no measured memory: the memory
coefficients come from the analytic model and the file says so (`memory_source: model`).
`validate_plans` then times micro-batches drawn from the policies' plans (`--validate K`);
`refit` fits the points of existing measured files again. docs/calibration.md has the why.

`prior` builds the same file from the analytic model and a device's rates instead of a timer
(`source: model`): the shipped H200 priors are made this way, reproducibly.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from adaptiveload.costmodel import (
    DEFAULT_MAX_LOO,
    FORMS,
    Calibration,
    CostModel,
    derive_budgets,
    fit,
    fit_measured,
)
from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.configs import WanConfig, get_config
from adaptiveload.model.wan import WanModel, build_on_meta, count_parameters
from adaptiveload.progress import progress_bar
from adaptiveload.provenance import device_name
from adaptiveload.tokens import FRAME_STEP, PIXEL_STEP

DEFAULT_BATCH_SIZES = (1, 2, 4)
DEFAULT_TOKENS = (16, 64, 256, 1024, 4096)
MAX_AXIS = 1024  # Wan's RoPE tables cover 1024 positions per axis
MIN_PASSES = 2  # a single pass cannot tell a point's spread, nor survive one burst of load
PROCESS_WARMUP_STEPS = 3  # whole-model steps before the first point (allocator, handles, code)
TIMING = (
    "forward+backward of one micro-batch, synchronised; a process warm-up of the whole model, "
    "then per point `warmup` steps; a point's time is the MINIMUM over `repeats` passes of the "
    "whole grid (fast points: the mean of several steps per pass); median and spread kept"
)


# --- the manifest side: which token counts the budgets must serve -------------------------


@dataclass(frozen=True)
class TokenMix:
    """Per-sample token counts of a (bucketed) manifest: what the budgets must serve."""

    tokens: np.ndarray
    origin: str
    samples: pd.DataFrame | None = field(default=None, repr=False, compare=False)  # bucketed

    def to_dict(self) -> dict[str, Any]:
        tok = self.tokens
        return {
            "origin": self.origin,
            "num_samples": int(tok.size),
            "tokens_min": int(tok.min()),
            "tokens_max": int(tok.max()),
            "tokens_p5": float(np.percentile(tok, 5)),
            "tokens_p95": float(np.percentile(tok, 95)),
        }


def token_mix(samples: pd.DataFrame, origin: str) -> TokenMix:
    """From bucketed samples (a `tokens` column)."""
    if samples.empty:
        raise UserError(f"{origin}: manifest has no samples (after bucketing); nothing to budget")
    return TokenMix(samples["tokens"].to_numpy(dtype=np.int64), origin, samples)


def manifest_token_mix(
    path: str | Path, bucketing: str = "aspect", grid: str = "wan", max_frames: int = 81
) -> TokenMix:
    """Load and bucket a manifest file (a file that already has `tokens` is used as it is)."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.manifest import load_manifest

    frame = load_manifest(path)
    if "tokens" not in frame.columns:
        frame = bucketize(frame, mode=bucketing, grid=grid, max_frames=max_frames).samples
    return token_mix(frame, str(path))


def mixture_token_mix(
    name: str, num_samples: int, seed: int = 0, bucketing: str = "aspect", grid: str = "wan",
    max_frames: int = 81,
) -> TokenMix:  # fmt: skip
    """A named synthetic mixture, bucketed."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.mixtures import synthesize

    frame = synthesize(name, num_samples, seed)
    samples = bucketize(frame, mode=bucketing, grid=grid, max_frames=max_frames).samples
    return token_mix(samples, f"mixture {name} (n={num_samples}, seed={seed}, grid={grid})")


def grid_token_mix(tokens: Sequence[int]) -> TokenMix:
    """No manifest: the grid's token counts stand in for it (one sample each)."""
    tok = np.asarray(sorted(tokens), dtype=np.int64)
    return TokenMix(tok, "calibration grid (no manifest given)")


# --- the device side -----------------------------------------------------------------------


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: WanModel, batch: tuple, device: torch.device) -> None:
    """One forward+backward; bf16 autocast on CUDA as in Wan training, fp32 on CPU."""
    x, t, context, target = batch
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = torch.nn.functional.mse_loss(model(x, t, context), target)
    loss.backward()
    model.zero_grad(set_to_none=True)


def _inputs(cfg: WanConfig, batch: int, tokens: int, device: torch.device, seed: int) -> tuple:
    """Random latents of the bucket shape, timesteps, text context and a regression target."""
    f, h, w = latent_grid(tokens)
    pt, ph, pw = cfg.patch_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, cfg.in_dim, f * pt, h * ph, w * pw, generator=gen)
    t = torch.rand(batch, generator=gen) * 1000
    context = torch.randn(batch, cfg.text_len, cfg.text_dim, generator=gen)
    return tuple(v.to(device) for v in (x, t, context, torch.randn_like(x)))


def _timed(model: WanModel, inputs: tuple, device: torch.device, iters: int) -> tuple[float, float]:
    """Mean (wall, thread CPU) seconds of `iters` synchronised forward+backward steps.

    Thread CPU time is the calling thread's work only: with one torch thread (CPU backward runs
    on the calling thread) it is the step's work without the time spent waiting for a core,
    which is what a loaded machine adds to wall time.
    """
    _sync(device)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        _step(model, inputs, device)
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
    inputs = _inputs(model.cfg, shape[0], shape[1], device, seed)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, inputs, device)
    _sync(device)
    return time.perf_counter() - start


def measure_grid(
    model: WanModel, grid: Sequence[tuple[int, int]], device: torch.device, repeats: int,
    warmup: int, seed: int = 0, min_seconds: float = 0.05, progress: bool = True,
    timer: str = "wall",
) -> list[dict[str, Any]]:  # fmt: skip
    """Time every (B, S) point: `warmup` steps each, then `repeats` passes over the whole grid.

    Passes (rather than back-to-back repeats) spread bursts of contention on a shared machine
    over all points instead of ruining one. A point's `time_s` is the minimum over passes of
    the `timer` seconds: interference (another process, a GC pause, a host hiccup) only ever
    adds time, so the minimum is the least contaminated estimate of what the step costs; the
    median and the spread ((max - min) / min over passes) are kept beside it. Fast points run
    several steps per pass (at least `min_seconds`) so timer and launch jitter average out.
    Both wall and thread-CPU seconds are kept. Peak memory (CUDA) is the max over passes,
    reset before every measurement.
    """
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
                inputs[b, s] = _inputs(model.cfg, b, s, device, seed)
                for _ in range(warmup):
                    _step(model, inputs[b, s], device)
                probe, _ = _timed(model, inputs[b, s], device, 1)
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
                    wall, cpu = _timed(model, inputs[key], device, iters[key])
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


def build_grid(
    batch_sizes: Sequence[int], tokens: Sequence[int], largest_bucket: int | None,
    max_batch_tokens: int | None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:  # fmt: skip
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


def _validate_grid(
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


def _resolve_device(device: str) -> torch.device:
    if device not in ("cpu", "cuda"):
        raise UserError(f"device '{device}': expected 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' requested but torch sees no CUDA GPU; use --device cpu")
    return torch.device(device)


def _provenance(device: torch.device) -> dict[str, Any]:
    return {
        "device": device_name(str(device)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


ATTENTION_REQUIRED_SHARE = 0.1  # attention FLOPs share at the largest S that makes b required


def required_terms(cfg: WanConfig, s_max: float) -> tuple[str, ...]:
    """Which per-sample terms the model's FLOPs say a fit must not pin at 0 over the grid.

    The linear term always (every token goes through the GEMMs); attention when its FLOPs
    are at least ATTENTION_REQUIRED_SHARE of a sample's at the largest measured S.
    """
    flops = analytic.flop_terms(cfg)
    share = flops.attention * s_max / (flops.linear + flops.attention * s_max)
    return ("a", "b") if share >= ATTENTION_REQUIRED_SHARE else ("a",)


def fit_points(
    cfg: WanConfig, device: str, points: list[dict[str, Any]], mix: TokenMix, capacity: float,
    headroom: float, setup: analytic.TrainingSetup, num_params: int, memory_measured: bool,
    max_loo: float | None = None, ref_tokens: float | None = None,
    ref_batch: int | None = None, extra: dict[str, Any] | None = None,
) -> Calibration:  # fmt: skip
    """Fit measured points (`time_s`, and `peak_bytes` if `memory_measured`), derive budgets.

    The fit is `costmodel.fit_measured` (floored form, leave-one-out checked, refused when
    degenerate); a derived p at a clamp bound is refused too. Without measured memory the
    memory terms come from the analytic model (`memory_source: model`). `max_loo` None: the
    device type's DEFAULT_MAX_LOO.
    """
    if max_loo is None:
        max_loo = DEFAULT_MAX_LOO["cuda" if device.startswith("cuda") else "cpu"]
    ok = [p for p in points if p["status"] == "ok" and p.get("time_s")]
    B = np.array([p["batch"] for p in ok], dtype=np.float64)
    S = np.array([p["tokens"] for p in ok], dtype=np.float64)
    T = np.array([p["time_s"] for p in ok], dtype=np.float64)
    if len(ok) < 4:
        raise UserError(
            f"only {len(ok)} of {len(points)} grid points ran on {device} ({len(points) - len(ok)}"
            " ran out of memory); use smaller batch sizes or token counts"
        )
    mem = np.array([p["peak_bytes"] for p in ok]) if memory_measured else None
    required = required_terms(cfg, float(S.max()))
    cost, stats = fit_measured(B, S, T, mem, required=required, max_loo=max_loo)
    if not memory_measured:
        m_static, m_tok, m_seq = analytic.memory_terms(cfg, num_params, setup)
        cost = replace(cost, m_static=m_static, m_tok=m_tok, m_seq=m_seq)
        for p in points:
            p["peak_bytes_model"] = float(cost.memory(p["batch"], p["tokens"]))
    loo = iter(stats.loo_rel_err or [])
    for p in ok:
        p["loo_rel_err"] = next(loo)
    budgets = derive_budgets(cost, mix.tokens, capacity, headroom, ref_tokens, ref_batch)
    if not 1.0 < budgets.p_unclamped < 2.0:
        raise UserError(
            f"derived p {budgets.p_unclamped:.3f} lies at or beyond the clamp [1, 2] over the "
            f"manifest's tokens {budgets.s_lo:.0f}..{budgets.s_hi:.0f}: the fitted per-sample "
            "cost does not bend like GEMMs plus attention there; add B = 1 points spanning "
            "that range"
        )
    return _calibration(
        cfg, device, "measured", cost, budgets, capacity, headroom, num_params, mix,
        extra={
            "memory_source": "measured" if memory_measured else "model",
            "fit": {**stats.to_dict(), "required_terms": list(required), "max_loo": max_loo},
            "points": points,
            **(extra or {}),
        },
    )  # fmt: skip


def calibrate(
    model_name: str,
    device: str = "cpu",
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    mix: TokenMix | None = None,
    capacity_gb: float | None = None,
    headroom: float = 0.1,
    repeats: int = 3,
    warmup: int = 1,
    activation_checkpointing: bool = False,
    ref_tokens: float | None = None,
    ref_batch: int | None = None,
    seed: int = 0,
    threads: int | None = None,
    timer: str = "auto",
    progress: bool = True,
    max_batch_tokens: int | None = None,
    max_loo: float | None = None,
    validate: int = 0,
    validate_world_size: int = 16,
    validate_max_seconds: float | None = None,
) -> Calibration:
    """Measure the grid on `device`, fit, derive budgets for `mix`; everything validated first.

    The grid follows `build_grid` (B = 1 at every size, the manifest's largest bucket
    included; the `max_batch_tokens` cap drops only B > 1 points and the file lists them).
    `threads` sets torch's intra-op threads for the measurement (match the training runs);
    None keeps the current setting. `timer` "wall" fits wall-clock seconds; "cpu" fits the
    calling thread's CPU seconds, which on a shared CPU machine with ONE thread is the work
    without the time spent waiting for a core (with more threads the work runs on other
    threads too, so it is refused). "auto" (the default): "cpu" with one thread on a CPU
    (unless `threads` > 1 is asked for, then "wall"), "wall" on CUDA. `max_loo` None: the
    device type's DEFAULT_MAX_LOO.

    `validate` > 0 then times that many micro-batches drawn from the plans of every policy
    at `validate_world_size` ranks (`validate_plans`); micro-batches predicted above
    `validate_max_seconds` are not drawn (their count is recorded).
    """
    cfg = get_config(model_name)
    dev = _resolve_device(device)
    _validate_grid(batch_sizes, tokens, repeats, warmup)
    if capacity_gb is None:
        if dev.type != "cuda":
            raise UserError("--capacity-gb is required on CPU (there is no device memory to read)")
        capacity = float(torch.cuda.get_device_properties(dev).total_memory)
    elif capacity_gb <= 0:
        raise UserError(f"capacity {capacity_gb} GB: expected > 0")
    else:
        capacity = capacity_gb * 1e9
    mix = mix or grid_token_mix(tokens)
    largest = int(mix.tokens.max())
    latent_grid(largest)
    grid, dropped = build_grid(batch_sizes, tokens, largest, max_batch_tokens)
    least = len(FORMS["three-term"]) + 2  # the smallest grid whose fit leave-one-out can check
    if len(grid) < least:
        raise UserError(
            f"grid {sorted(set(batch_sizes))} x {sorted(set(tokens))} (cap {max_batch_tokens}) "
            f"leaves {len(grid)} grid point(s); a checked fit needs >= {least}: add token sizes "
            "or batch sizes, or raise --max-batch-tokens"
        )
    if len({b for b, _ in grid}) < 2:
        raise UserError(
            f"grid {sorted(set(batch_sizes))} x {sorted(set(tokens))} (cap {max_batch_tokens}) "
            "keeps no B > 1 point: the fit cannot tell the per-micro-batch from the per-sample "
            "cost; add a batch size > 1 or raise --max-batch-tokens"
        )
    if timer not in ("auto", "wall", "cpu"):
        raise UserError(f"timer '{timer}': expected 'auto', 'wall' or 'cpu'")
    if timer == "auto":
        timer = "cpu" if dev.type == "cpu" and threads in (None, 1) else "wall"
        threads = 1 if timer == "cpu" else threads
    if timer == "cpu" and (dev.type == "cuda" or (threads or torch.get_num_threads()) != 1):
        raise UserError("timer 'cpu' needs --device cpu and --threads 1")
    if threads is not None:
        if threads < 1:
            raise UserError(f"threads {threads}: expected >= 1")
        torch.set_num_threads(threads)
    if validate < 0 or validate_world_size < 1:
        raise UserError("--validate and --validate-world-size: expected >= 0 and >= 1")
    if validate and mix.samples is None:
        raise UserError("--validate needs a --manifest or --mixture to plan micro-batches from")

    torch.manual_seed(seed)
    model = WanModel(cfg, activation_checkpointing=activation_checkpointing).to(dev)
    # Adam state exists in real training: allocate it (lr 0 leaves the weights alone)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)

    process_warmup_s = warm_up_process(model, grid[0], dev, PROCESS_WARMUP_STEPS, seed)
    points = measure_grid(model, grid, dev, repeats, warmup, seed, progress=progress, timer=timer)
    num_params = count_parameters(model)
    setup = analytic.TrainingSetup(
        compute_bytes=2 if dev.type == "cuda" else 4,
        activation_checkpointing=activation_checkpointing,
    )
    notes = []
    if dev.type == "cpu":
        notes.append(
            "CPU: no measured memory; m_static/m_tok/m_seq come from the analytic model "
            "(adaptiveload.model.analytic.memory_terms, fp32 training, AdamW)"
        )
        notes.append(
            "CPU timings on a shared machine are noisy (see provenance.load_average_1m and "
            "fit.loo_max); --threads 1 --timer cpu is the stable choice there"
        )
    name = device_name(str(dev))
    cal = fit_points(
        cfg, name, points, mix, capacity, headroom, setup, num_params,
        memory_measured=dev.type == "cuda", max_loo=max_loo, ref_tokens=ref_tokens,
        ref_batch=ref_batch,
        extra={
            "provenance": _provenance(dev),
            "setup": _setup_dict(setup, "bf16 autocast" if dev.type == "cuda" else "fp32"),
            "grid": {"batch_sizes": sorted(set(batch_sizes)), "tokens": sorted(set(tokens)),
                     "largest_bucket": largest, "repeats": repeats, "warmup": warmup,
                     "process_warmup_steps": PROCESS_WARMUP_STEPS,
                     "process_warmup_s": process_warmup_s, "timing": TIMING, "timer": timer,
                     "statistic": "min over passes", "max_batch_tokens": max_batch_tokens,
                     "dropped_by_max_batch_tokens": [list(bs) for bs in dropped]},
            "notes": notes,
        },
    )  # fmt: skip
    if validate:
        cal.extra["validation"] = validate_plans(
            model, cal, mix, dev, validate, validate_world_size, validate_max_seconds,
            repeats=repeats, seed=seed, timer=timer, progress=progress,
        )  # fmt: skip
    return cal


def draw_micro_batches(
    cal: Calibration, mix: TokenMix, k: int, world_size: int, max_seconds: float | None,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], int, int]:  # fmt: skip
    """`k` micro-batches (policy, B, S) drawn from one epoch's plan of every policy.

    Each policy is planned with the calibration's own budgets on the mix's samples at
    `world_size` ranks (what the simulations run); its real (non-padding) micro-batches are
    the population, and k is split evenly over the policies (seeded). Micro-batches predicted
    above `max_seconds` are left out of the population; their number is returned, and the
    number of micro-batches in all plans.
    """
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import POLICIES, Budgets

    budgets = Budgets.resolve(calibration=cal)
    rng = np.random.default_rng(seed)
    drawn, too_slow, population = [], 0, 0
    names = list(POLICIES)
    for i, name in enumerate(names):
        table = build_plan(mix.samples, name, budgets, world_size, seed, cost_model=cal).table
        real = table[~table["is_padding"]]
        batches = real.groupby("batch_id").agg(
            batch=("sample_id", "size"), tokens=("tokens", "first")
        )
        pred = cal.cost.step_time(batches["batch"], batches["tokens"])
        population += len(batches)
        if max_seconds is not None:
            too_slow += int((pred > max_seconds).sum())
            batches = batches[pred <= max_seconds]
        share = k // len(names) + (i < k % len(names))
        if batches.empty or share == 0:
            continue
        pick = rng.choice(len(batches), size=share, replace=len(batches) < share)
        for j in sorted(pick):
            row = batches.iloc[j]
            drawn.append({"policy": name, "batch": int(row["batch"]), "tokens": int(row["tokens"])})
    return drawn, too_slow, population


def validate_plans(
    model: WanModel, cal: Calibration, mix: TokenMix, device: torch.device, k: int,
    world_size: int, max_seconds: float | None, repeats: int, seed: int, timer: str,
    progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """Time `k` planned micro-batches (`draw_micro_batches`) like grid points; compare.

    The error of each is |predicted - measured| / measured, measured as a grid point is (the
    minimum over `repeats` passes, after one untimed step of the shape), so that the validation
    checks the cost model on the shapes the planner really makes, not on the grid it was
    fitted to.
    """
    drawn, too_slow, population = draw_micro_batches(cal, mix, k, world_size, max_seconds, seed)
    shapes = sorted({(d["batch"], d["tokens"]) for d in drawn}, key=lambda bs: bs[0] * bs[1])
    # the model is warm from the grid: a new shape's untimed probe step is its warm-up
    measured = {
        (p["batch"], p["tokens"]): p
        for p in measure_grid(model, shapes, device, repeats, 0, seed, progress=progress,
                              timer=timer)
    }  # fmt: skip
    rows = []
    for d in drawn:
        point = measured[d["batch"], d["tokens"]]
        pred = float(cal.cost.step_time(d["batch"], d["tokens"]))
        meas = point["time_s"]
        rows.append({
            **d, "predicted_s": pred, "measured_s": meas, "spread": point["spread"],
            "status": point["status"],
            "rel_err": abs(pred - meas) / meas if meas else None,
        })  # fmt: skip
    errors = np.array([r["rel_err"] for r in rows if r["rel_err"] is not None])
    return {
        "k": k,
        "world_size": world_size,
        "manifest": mix.origin,
        "max_seconds": max_seconds,
        "planned_micro_batches": population,
        "excluded_over_max_seconds": too_slow,
        "num_measured": int(errors.size),
        "median_rel_err": float(np.median(errors)) if errors.size else None,
        "p95_rel_err": float(np.percentile(errors, 95)) if errors.size else None,
        "micro_batches": rows,
    }


def refit(
    paths: Sequence[str | Path], mix: TokenMix, headroom: float = 0.1,
    max_loo: float | None = None, ref_tokens: float | None = None,
    ref_batch: int | None = None,
) -> Calibration:  # fmt: skip
    """Refit the points of measured calibration files with today's form, checks and budgets.

    Several files of the same model, device and setup are pooled: every pass of a (B, S)
    point counts, its time is the minimum over all of them (as in `measure_grid`) and its
    peak memory the maximum. The budgets are derived for `mix`; the provenance lists the
    source files and what their grids lacked by today's rules (docs/calibration.md).
    """
    if not paths:
        raise UserError("--refit needs at least one measured calibration file")
    sources = [(str(path), Calibration.load(path)) for path in paths]
    first = sources[0][1]
    for path, cal in sources:
        if cal.source != "measured" or not cal.extra.get("points"):
            raise UserError(f"{path}: not a measured calibration with points; cannot refit it")
        same = (cal.model, cal.device, cal.extra.get("setup"), cal.capacity_bytes)
        if same != (first.model, first.device, first.extra.get("setup"), first.capacity_bytes):
            raise UserError(
                f"{path}: model, device, setup or capacity differ from {sources[0][0]}; "
                "refit files of one measurement setup together"
            )
    timer = first.extra.get("grid", {}).get("timer", "wall")
    pooled: dict[tuple[int, int], dict[str, Any]] = {}
    for _, cal in sources:
        for point in cal.extra["points"]:
            key = (int(point["batch"]), int(point["tokens"]))
            into = pooled.setdefault(key, {
                "batch": key[0], "tokens": key[1], "status": "oom", "peak_bytes": None,
                f"{timer}_s_passes": [],
            })  # fmt: skip
            passes = point.get(f"{timer}_s_passes") or []
            if point.get("status") == "ok" and passes:
                into["status"] = "ok"
                into[f"{timer}_s_passes"] += passes
                peak = point.get("peak_bytes")
                if peak is not None:
                    into["peak_bytes"] = max(into["peak_bytes"] or 0.0, float(peak))
    points = sorted(pooled.values(), key=lambda p: (p["batch"] * p["tokens"], p["batch"]))
    for point in points:
        passes = point[f"{timer}_s_passes"]
        point["time_s"] = min(passes) if passes else None
        point[f"{timer}_s_median"] = statistics.median(passes) if passes else None
        point["spread"] = pass_spread(passes)
    cfg = get_config(first.model)
    setup_info = first.extra.get("setup", {})
    setup = analytic.TrainingSetup(
        compute_bytes=2 if first.device.startswith("cuda") else 4,
        activation_checkpointing=bool(setup_info.get("activation_checkpointing")),
        shard_world_size=int(setup_info.get("shard_world_size", 1)),
    )
    memory_measured = first.extra.get("memory_source") == "measured"
    grids = [cal.extra.get("grid", {}) for _, cal in sources]
    lacking = []
    if any(g.get("warmup", 1) < 1 for g in grids):
        lacking.append("no per-point warm-up and no process warm-up (cold first points)")
    if any(g.get("max_batch_tokens") for g in grids):
        measured_b1 = {k[1] for k, p in pooled.items() if k[0] == 1 and p["status"] == "ok"}
        if int(mix.tokens.max()) not in measured_b1:
            lacking.append(
                f"B = 1 at the largest bucket ({int(mix.tokens.max())} tokens) was not measured "
                "(dropped by a batch-token cap): the reference bucket is extrapolated"
            )
    return fit_points(
        cfg, first.device, points, mix, float(first.capacity_bytes), headroom, setup,
        int(first.extra.get("num_params") or count_parameters(build_on_meta(cfg))),
        memory_measured=memory_measured, max_loo=max_loo, ref_tokens=ref_tokens,
        ref_batch=ref_batch,
        extra={
            "provenance": {
                "generator": "adaptiveload.calibration.refit",
                "refit_of": [
                    {"file": path, "date": cal.extra.get("provenance", {}).get("date"),
                     "torch": cal.extra.get("provenance", {}).get("torch"),
                     "cuda": cal.extra.get("provenance", {}).get("cuda")}
                    for path, cal in sources
                ],
                "refit_date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
            },
            "setup": setup_info,
            "grid": {**grids[0], "statistic": "min over passes (pooled over the source files)",
                     "pooled_files": len(sources)},
            "notes": [f"grid lacked by today's rules: {what}" for what in lacking],
        },
    )  # fmt: skip


def _setup_dict(setup: analytic.TrainingSetup, precision: str) -> dict[str, Any]:
    return {
        "precision": precision,
        "activation_checkpointing": setup.activation_checkpointing,
        "optimizer": "AdamW (fp32 states)",
        "shard_world_size": setup.shard_world_size,
    }


def _calibration(
    cfg: WanConfig, device: str, source: str, cost: CostModel, budgets: Any, capacity: float,
    headroom: float, num_params: int, mix: TokenMix, extra: dict[str, Any],
) -> Calibration:  # fmt: skip
    return Calibration(
        model=cfg.name,
        device=device,
        source=source,
        cost=cost,
        p=budgets.p,
        m_mem=budgets.m_mem,
        m_comp=budgets.m_comp,
        m_tok=budgets.m_tok,
        capacity_bytes=capacity,
        extra={
            "headroom": headroom,
            "num_params": num_params,
            "grad_bytes": num_params * 4,
            "model_config": cfg.to_dict(),
            "budgets": budgets.to_dict(),
            "manifest": mix.to_dict(),
            **extra,
        },
    )


# --- analytic priors -------------------------------------------------------------------------

# How the priors assume the model is trained (see TrainingSetup): bf16 autocast, per-block
# activation checkpointing, AdamW. The 14B's 229 GB of fp32 weights+grads+Adam cannot live on
# one 141 GB device, so its prior shards them over 16 ranks (FSDP/ZeRO-3; the default
# simulation world size); the 1.3B is plain data parallel.
PRIOR_SETUPS = {
    "wan2.1-t2v-14b": analytic.TrainingSetup(shard_world_size=16),
}
PRIOR_BATCH_SIZES = (1, 2, 4, 8)


def prior(
    model_name: str,
    rates: str = "h200",
    mix: TokenMix | None = None,
    headroom: float = 0.1,
    ref_tokens: float | None = None,
    ref_batch: int | None = None,
    num_tokens: int = 10,
) -> Calibration:
    """A `source: model` calibration: the analytic step time and memory of `model_name` on a
    device's rates, evaluated on a grid spanning the manifest's tokens and fitted like a
    measurement (so its fit statistics say how well the form captures the analytic model)."""
    cfg = get_config(model_name)
    if rates not in analytic.PRIORS:
        raise UserError(f"prior '{rates}': unknown; expected one of {', '.join(analytic.PRIORS)}")
    device = analytic.PRIORS[rates]
    setup = PRIOR_SETUPS.get(cfg.name, analytic.TrainingSetup())
    if mix is None:
        raise UserError("a prior needs a manifest or mixture for its token range")
    lo, hi = int(mix.tokens.min()), int(mix.tokens.max())
    tokens = sorted({int(s) for s in np.geomspace(lo, max(hi, lo + 1), num_tokens)})
    num_params = count_parameters(build_on_meta(cfg))
    m_static, m_tok, m_seq = analytic.memory_terms(cfg, num_params, setup)
    points = [
        {"batch": b, "tokens": s, "time_s": analytic.step_time(cfg, device, setup, b, s)}
        for s in tokens
        for b in PRIOR_BATCH_SIZES
    ]
    B = np.array([p["batch"] for p in points])
    S = np.array([p["tokens"] for p in points])
    cost, stats = fit(B, S, np.array([p["time_s"] for p in points]))
    cost = replace(cost, m_static=m_static, m_tok=m_tok, m_seq=m_seq)
    for p in points:
        p["peak_bytes_model"] = float(cost.memory(p["batch"], p["tokens"]))
    capacity = device.capacity_bytes
    budgets = derive_budgets(cost, mix.tokens, capacity, headroom, ref_tokens, ref_batch)
    return _calibration(
        cfg, device.name, "model", cost, budgets, capacity, headroom, num_params, mix,
        extra={
            "memory_source": "model",
            "provenance": {
                "generator": "adaptiveload.calibration.prior",
                "command": f"adaptiveload calibrate --prior {rates} --model {cfg.name} "
                "--mixture NAME --num-samples N (see `manifest.origin`)",
                "date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
                "torch": torch.__version__,
            },
            "rates": device.to_dict(),
            "setup": _setup_dict(setup, "bf16 autocast (assumed)"),
            "analytic": {
                "flop_terms_forward": analytic.flop_terms(cfg).__dict__,
                "activation_bytes_per_token_block": analytic.activation_bytes_per_token_block(
                    cfg, setup
                ),
                "assumptions": [
                    "step time = overhead + B * (GEMM FLOPs / (rate*linear_eff) + attention "
                    "FLOPs / (rate*attention_eff) + element-wise bytes / (copy*memory_eff))",
                    "FLOPs: forward x3 for forward+backward, x4 with per-block activation "
                    "checkpointing (recomputed forward)",
                    "memory: static = params * (16 B fp32 weights+grads+AdamW + 2 B bf16 weight "
                    "copy) / shard_world_size; activations counted tensor by tensor "
                    "(activation_bytes_per_token_block); with checkpointing, every block "
                    "input (fp32) + one block's activations",
                ],
            },
            "grid": {"batch_sizes": list(PRIOR_BATCH_SIZES), "tokens": tokens},
            "fit": stats.to_dict(),
            "points": points,
            "notes": [
                "source: model. Replace it with a measurement on an H200 (the 1.3B fits one "
                "GPU; the 14B's optimizer state needs sharding): `adaptiveload calibrate --model "
                f"{cfg.name} --device cuda --activation-checkpointing --batch-sizes 1,2,4 "
                "--tokens 1560,3600,7800,14040,32760 --mixture paper-mixed -o FILE`",
                "budget rules (`budgets.rules`): one reference batch, the heaviest bucket within "
                "M_mem at its memory-limited batch B_ref; M_tok = B_ref * S_ref (equal-token), "
                "M_comp = B_ref * S_ref^p (AdaptiveLoad)",
            ],
        },
    )  # fmt: skip
