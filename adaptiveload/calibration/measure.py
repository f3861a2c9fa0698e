"""`calibrate`: measure a model on this device over the grid, fit, derive the budgets, and
optionally validate against planned micro-batches; every input is checked before the model is
built."""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Sequence
from typing import Any

import torch

from adaptiveload.calibration.files import fit_points, setup_dict
from adaptiveload.calibration.fit import FORMS
from adaptiveload.calibration.grid import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_TOKENS,
    build_grid,
    latent_grid,
    validate_grid,
)
from adaptiveload.calibration.mix import TokenMix, grid_token_mix
from adaptiveload.calibration.timing import (
    PROCESS_WARMUP_STEPS,
    TIMING,
    measure_grid,
    warm_up_process,
)
from adaptiveload.calibration.validate import validate_plans
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.architectures import WanConfig, get_config
from adaptiveload.model.wan import WanModel, count_parameters
from adaptiveload.provenance import device_name


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


def _capacity(device: torch.device, capacity_gb: float | None) -> float:
    """The bytes to budget against: `capacity_gb`, or on CUDA the device's own memory."""
    if capacity_gb is None:
        if device.type != "cuda":
            raise UserError("--capacity-gb is required on CPU (there is no device memory to read)")
        return float(torch.cuda.get_device_properties(device).total_memory)
    if capacity_gb <= 0:
        raise UserError(f"capacity {capacity_gb} GB: expected > 0")
    return capacity_gb * 1e9


def _checked_grid(
    batch_sizes: Sequence[int], tokens: Sequence[int], largest: int,
    max_batch_tokens: int | None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:  # fmt: skip
    """`build_grid`, refused when what is left cannot give a checked fit."""
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
    return grid, dropped


def _timer_and_threads(
    device: torch.device, timer: str, threads: int | None
) -> tuple[str, int | None]:
    """The timer `auto` stands for, and the threads it needs (see `calibrate`)."""
    if timer not in ("auto", "wall", "cpu"):
        raise UserError(f"timer '{timer}': expected 'auto', 'wall' or 'cpu'")
    if timer == "auto":
        timer = "cpu" if device.type == "cpu" and threads in (None, 1) else "wall"
        threads = 1 if timer == "cpu" else threads
    if timer == "cpu" and (device.type == "cuda" or (threads or torch.get_num_threads()) != 1):
        raise UserError("timer 'cpu' needs --device cpu and --threads 1")
    if threads is not None and threads < 1:
        raise UserError(f"threads {threads}: expected >= 1")
    return timer, threads


def _model_with_optimizer_state(
    cfg: WanConfig, device: torch.device, activation_checkpointing: bool, seed: int
) -> WanModel:
    """The model on `device` with AdamW state allocated, as in real training (lr 0 leaves the
    weights alone)."""
    torch.manual_seed(seed)
    model = WanModel(cfg, activation_checkpointing=activation_checkpointing).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return model


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
    validate_grid(batch_sizes, tokens, repeats, warmup)
    capacity = _capacity(dev, capacity_gb)
    mix = mix or grid_token_mix(tokens)
    largest = int(mix.tokens.max())
    grid, dropped = _checked_grid(batch_sizes, tokens, largest, max_batch_tokens)
    timer, threads = _timer_and_threads(dev, timer, threads)
    if threads is not None:
        torch.set_num_threads(threads)
    if validate < 0 or validate_world_size < 1:
        raise UserError("--validate and --validate-world-size: expected >= 0 and >= 1")
    if validate and mix.samples is None:
        raise UserError("--validate needs a --manifest or --mixture to plan micro-batches from")

    model = _model_with_optimizer_state(cfg, dev, activation_checkpointing, seed)

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
            "setup": setup_dict(setup, "bf16 autocast" if dev.type == "cuda" else "fp32"),
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
