"""Measure how a Wan model's training step grows with B and S on this device; derive budgets.

`calibrate` times forward+backward micro-batches over a (B, S) grid of bucket shapes (warm-up,
then the median of several synchronised repeats), records peak memory where the device can
report it (CUDA), fits the cost model and derives p, M_mem, M_comp and the equal-token
baseline's M_tok for a manifest (`costmodel.BUDGET_RULES`). On CPU there is no measured memory:
the memory coefficients come from the analytic model and the file says so
(`memory_source: model`).

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from adaptiveload.costmodel import Calibration, CostModel, derive_budgets, fit
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
TIMING = (
    "forward+backward of one micro-batch, synchronised; warm-up, then the median over "
    "`repeats` passes of the whole grid (fast points: the mean of several steps per pass)"
)


# --- the manifest side: which token counts the budgets must serve -------------------------


@dataclass(frozen=True)
class TokenMix:
    """Per-sample token counts of a (bucketed) manifest: what the budgets must serve."""

    tokens: np.ndarray
    origin: str

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
    return TokenMix(samples["tokens"].to_numpy(dtype=np.int64), origin)


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
    """Mean (wall, process CPU) seconds of `iters` synchronised forward+backward steps."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        _step(model, inputs, device)
    _sync(device)
    return (time.perf_counter() - wall) / iters, (time.process_time() - cpu) / iters


def _drop_oom(model: WanModel, point: dict, inputs: dict, key: tuple[int, int]) -> None:
    """Mark a point out-of-memory and release what the failed step held."""
    point["status"] = "oom"
    point["wall_s"], point["cpu_s"] = [], []
    inputs.pop(key, None)
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()


def measure_grid(
    model: WanModel, grid: Sequence[tuple[int, int]], device: torch.device, repeats: int,
    warmup: int, seed: int = 0, min_seconds: float = 0.05, progress: bool = True,
) -> list[dict[str, Any]]:  # fmt: skip
    """Time every (B, S) point: `warmup` steps each, then `repeats` passes over the whole grid.

    Passes (rather than back-to-back repeats) spread bursts of contention on a shared machine
    over all points instead of ruining one; each point's time is the median over passes. Fast
    points run several steps per pass (at least `min_seconds`) so timer and launch jitter
    average out. Both wall and process-CPU seconds are kept. Peak memory (CUDA) is the max
    over passes, reset before every measurement.
    """
    points: dict[tuple[int, int], dict[str, Any]] = {}
    inputs: dict[tuple[int, int], tuple] = {}
    iters: dict[tuple[int, int], int] = {}
    total = len(grid) * (1 + repeats)
    with progress_bar(total=total, desc="calibrate", disable=not progress) as bar:
        for b, s in grid:  # warm-up pass, smallest first; finds what fits
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
            point[name] = statistics.median(samples) if samples else None
        point["steps_per_pass"] = iters.get(key)
    return list(points.values())


def _validate_grid(batch_sizes: Sequence[int], tokens: Sequence[int], repeats: int) -> None:
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError(f"batch sizes {list(batch_sizes)}: expected integers >= 1")
    if len(set(tokens)) < 2 or min(tokens) < 1:
        raise UserError(
            f"tokens {list(tokens)}: expected at least 2 distinct token counts >= 1 "
            "(the quadratic term needs them)"
        )
    if len(set(batch_sizes)) * len(set(tokens)) < 4:
        raise UserError("grid has fewer than 4 (B, S) points: the fit has 4 coefficients")
    if repeats < 1:
        raise UserError(f"repeats {repeats}: expected >= 1")
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
    timer: str = "wall",
    progress: bool = True,
    max_batch_tokens: int | None = None,
) -> Calibration:
    """Measure the grid on `device`, fit, derive budgets for `mix`; everything validated first.

    `threads` sets torch's intra-op threads for the measurement (match the training runs);
    None keeps the current setting. Both are recorded in the provenance. `timer` "wall" (the
    default) fits wall-clock seconds; "cpu" fits process CPU seconds, which on a shared CPU
    machine with ONE thread is the work without the time spent waiting for a core (with more
    threads it counts spin-waiting too, so it is refused).

    `max_batch_tokens` drops the grid points with B*S above it: the large-B corners of a
    paper-scale grid (B=2 at 75.6k tokens is ~25 s a step on an H200) add little to a fit
    that is linear in B, and a device check cannot afford them.
    """
    cfg = get_config(model_name)
    dev = _resolve_device(device)
    batch_sizes, tokens = sorted(set(batch_sizes)), sorted(set(tokens))
    _validate_grid(batch_sizes, tokens, repeats)
    grid = [(b, s) for s in tokens for b in batch_sizes]
    if max_batch_tokens is not None:
        grid = [(b, s) for b, s in grid if b * s <= max_batch_tokens]
        if len(grid) < 4 or len({s for _, s in grid}) < 2 or len({b for b, _ in grid}) < 2:
            raise UserError(
                f"max batch tokens {max_batch_tokens}: leaves {len(grid)} grid point(s); the "
                "fit needs >= 4 points with >= 2 token counts and >= 2 batch sizes"
            )
    if capacity_gb is None:
        if dev.type != "cuda":
            raise UserError("--capacity-gb is required on CPU (there is no device memory to read)")
        capacity = float(torch.cuda.get_device_properties(dev).total_memory)
    elif capacity_gb <= 0:
        raise UserError(f"capacity {capacity_gb} GB: expected > 0")
    else:
        capacity = capacity_gb * 1e9
    mix = mix or grid_token_mix(tokens)
    if timer not in ("wall", "cpu"):
        raise UserError(f"timer '{timer}': expected 'wall' or 'cpu'")
    if timer == "cpu" and (dev.type == "cuda" or (threads or torch.get_num_threads()) != 1):
        raise UserError("timer 'cpu' needs --device cpu and --threads 1")
    if threads is not None:
        if threads < 1:
            raise UserError(f"threads {threads}: expected >= 1")
        torch.set_num_threads(threads)

    torch.manual_seed(seed)
    model = WanModel(cfg, activation_checkpointing=activation_checkpointing).to(dev)
    # Adam state exists in real training: allocate it (lr 0 leaves the weights alone)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)

    points = measure_grid(model, grid, dev, repeats, warmup, seed, progress=progress)

    for point in points:
        point["time_s"] = point[f"{timer}_s"]
    ok = [p for p in points if p["status"] == "ok"]
    if len(ok) < 4 or len({p["tokens"] for p in ok}) < 2:
        raise UserError(
            f"only {len(ok)} of {len(points)} grid points ran on {device_name(str(dev))} "
            "(the rest ran out of memory); use smaller batch sizes or token counts"
        )
    B = np.array([p["batch"] for p in ok])
    S = np.array([p["tokens"] for p in ok])
    T = np.array([p["time_s"] for p in ok])
    num_params = count_parameters(model)
    setup = analytic.TrainingSetup(
        compute_bytes=2 if dev.type == "cuda" else 4,
        activation_checkpointing=activation_checkpointing,
    )
    if dev.type == "cuda":
        cost, stats = fit(B, S, T, mem=np.array([p["peak_bytes"] for p in ok]))
        memory_source = "measured"
    else:
        cost, stats = fit(B, S, T)
        m_static, m_tok, m_seq = analytic.memory_terms(cfg, num_params, setup)
        cost = replace(cost, m_static=m_static, m_tok=m_tok, m_seq=m_seq)
        memory_source = "model"
        for p in points:
            p["peak_bytes_model"] = float(cost.memory(p["batch"], p["tokens"]))
    budgets = derive_budgets(cost, mix.tokens, capacity, headroom, ref_tokens, ref_batch)
    notes = []
    if dev.type == "cpu":
        notes.append(
            "CPU: no measured memory; m_static/m_tok/m_seq come from the analytic model "
            "(adaptiveload.model.analytic.memory_terms, fp32 training, AdamW)"
        )
        notes.append(
            "CPU timings on a shared machine are noisy (see provenance.load_average_1m and "
            "fit.max_rel_err); --threads 1 --timer cpu is the stable choice there"
        )
    return _calibration(
        cfg, device_name(str(dev)), "measured", cost, budgets, capacity, headroom, num_params, mix,
        extra={
            "memory_source": memory_source,
            "provenance": _provenance(dev),
            "setup": _setup_dict(setup, "bf16 autocast" if dev.type == "cuda" else "fp32"),
            "grid": {"batch_sizes": batch_sizes, "tokens": tokens, "repeats": repeats,
                     "warmup": warmup, "timing": TIMING, "timer": timer,
                     "max_batch_tokens": max_batch_tokens},
            "fit": stats.to_dict(),
            "points": points,
            "notes": notes,
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
