"""`calibrate`: measure a model on this device over the grid, fit, derive the budgets, and
optionally validate against planned micro-batches; every input is checked before the model is
built."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from adaptiveload.calibration.additivity import held_out
from adaptiveload.calibration.files import fit_points, setup_dict
from adaptiveload.calibration.fit import FORMS
from adaptiveload.calibration.grid import build_grid, latent_grid, memory_points
from adaptiveload.calibration.mix import TokenMix, grid_token_mix
from adaptiveload.calibration.settings import CalibrationConfig, Grid
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
from adaptiveload.model.lora import LoraSpec, add_lora, spec_record
from adaptiveload.model.wan import WanModel, count_parameters
from adaptiveload.provenance import device_name, measurement_provenance


def _resolve_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' requested but torch sees no CUDA GPU; use --device cpu")
    return torch.device(device)


def _own_memory(device: torch.device) -> float | None:
    """The device's own memory in bytes (CUDA); None where there is none to read."""
    if device.type != "cuda":
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)


def _checked_grid(
    grid: Grid, largest: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """`build_grid`, refused when what is left cannot give a checked fit."""
    latent_grid(largest)
    points, dropped = build_grid(grid.batch_sizes, grid.tokens, largest, grid.max_batch_tokens)
    least = len(FORMS["three-term"]) + 2  # the smallest grid whose fit leave-one-out can check
    what = (f"grid {sorted(set(grid.batch_sizes))} x {sorted(set(grid.tokens))} "
            f"(cap {grid.max_batch_tokens})")
    if len(points) < least:
        raise UserError(
            f"{what} leaves {len(points)} grid point(s); a checked fit needs >= {least}: add "
            "token sizes or batch sizes, or raise --max-batch-tokens"
        )
    if len({b for b, _ in points}) < 2:
        raise UserError(
            f"{what} keeps no B > 1 point: the fit cannot tell the per-micro-batch from the "
            "per-sample cost; add a batch size > 1 or raise --max-batch-tokens"
        )
    return points, dropped


def _model_with_optimizer_state(
    cfg: WanConfig,
    device: torch.device,
    activation_checkpointing: bool,
    seed: int,
    lora: LoraSpec | None = None,
) -> WanModel:
    """The model on `device` with AdamW state allocated, as in real training (lr 0 leaves the
    weights alone); with `lora`, adapters on a frozen base and state for them alone, as a
    LoRA run trains (its backward computes no weight gradients of the base)."""
    torch.manual_seed(seed)
    model = WanModel(cfg, activation_checkpointing=activation_checkpointing).to(device)
    if lora is not None:
        model = add_lora(model, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.0)
    for p in trained:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return model


def calibrate(cfg: CalibrationConfig, progress: bool = True) -> Calibration:
    """Measure `cfg.grid` on `cfg.device`, fit, derive the budgets for the token mix, and
    validate against planned micro-batches if asked; every input is checked first.

    The grid follows `build_grid` (B = 1 at every size, the mix's largest bucket included;
    the `max_batch_tokens` cap drops only B > 1 points and the file lists them). The grid's
    packs are timed in the same passes and held out of the fit: the file's `additivity`
    compares them with the fitted cost of a set (`additivity.held_out`). The clock
    and its torch threads are `cfg.clock()` (match the training runs'). Validation draws
    micro-batches from the plans of every policy (`validate.validate_plans`); those predicted
    above its `max_seconds` are not drawn (their count is recorded).
    """
    cfg.check_measurement()
    arch = get_config(cfg.model)
    dev = _resolve_device(cfg.device)
    capacity = cfg.budgets.capacity_bytes(_own_memory(dev))
    mix = cfg.mix.load(cfg.model) or grid_token_mix(cfg.grid.tokens)
    largest = int(mix.tokens.max())
    points, dropped = _checked_grid(cfg.grid, largest)
    timer, threads = cfg.clock()
    if threads is not None:
        torch.set_num_threads(threads)
    if timer == "cpu" and torch.get_num_threads() != 1:
        raise UserError("timer 'cpu' needs --device cpu and --threads 1")

    model = _model_with_optimizer_state(
        arch, dev, cfg.activation_checkpointing, cfg.seed, cfg.lora
    )
    process_warmup_s = warm_up_process(model, points[0], dev, PROCESS_WARMUP_STEPS, cfg.seed)
    measured, packs = measure_grid(model, points, dev, cfg.grid, cfg.seed, progress=progress,
                                   timer=timer)
    record = {
        "process_warmup_s": process_warmup_s, "timer": timer, "largest_bucket": largest,
        "dropped_by_max_batch_tokens": [list(bs) for bs in dropped],
    }
    cal = _fit(cfg, arch, dev, measured, mix, capacity, model, record)
    cal = _memory_to_budgets(cfg, cal, model, measured, (mix, capacity, record), timer, progress)
    additivity = held_out(cal.cost, packs, memory_measured=dev.type == "cuda", timer=timer)
    if additivity:
        cal.extra["additivity"] = additivity
    # the step timed: a LoRA run's or full training's (training warns on a mismatch)
    cal.extra.setdefault("setup", {})["lora"] = spec_record(cfg.lora)
    if cfg.validation.micro_batches:
        cal.extra["validation"] = validate_plans(
            model, cal, mix, dev, cfg.validation, cfg.grid, cfg.seed, timer, progress
        )
    return cal


def _memory_targets(
    cal: Calibration, mix: TokenMix, world_size: int, seed: int
) -> dict[str, float]:
    """The largest micro-batches (tokens) the derived budgets let the plans form: M_mem (what
    the homogeneous policies' B·S reaches) and, where the mix has samples, the largest pack of
    the packed policy's plan of them at `world_size` ranks (the simulations' world size)."""
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import POLICIES, Budgets

    targets = {"m_mem": float(cal.m_mem)}
    if mix.samples is not None:
        packed = next(name for name, policy in POLICIES.items() if policy.packed)
        budgets = Budgets.resolve(calibration=cal)
        plan = build_plan(mix.samples, packed, budgets, world_size, seed, cost_model=cal)
        targets["largest_pack"] = float(plan.summary["max_tokens_per_batch"])
    return targets


def _memory_to_budgets(
    cfg: CalibrationConfig,
    cal: Calibration,
    model: WanModel,
    measured: list[dict[str, Any]],
    fitted: tuple[TokenMix, float, dict[str, Any]],
    timer: str,
    progress: bool,
) -> Calibration:
    """Measure peak memory up to the budgets the first fit derived (`grid.memory_points`:
    M_mem and the largest pack, beyond the grid's largest micro-batch) and fit memory again
    with them, so M_mem rests on measured points. One pass each, no warm-up (peak memory is
    deterministic; their times stay out of the time fit); a point that runs out of memory is
    recorded with status "oom" and left out, never retried. Where the device reports no
    memory (CPU) the points are only listed (`grid.memory_points_not_measured`)."""
    mix, capacity, record = fitted
    targets = _memory_targets(cal, mix, cfg.validation.world_size, cfg.seed)
    reached = max((p["batch"] * p["tokens"] for p in measured if p["status"] == "ok"), default=0)
    wanted = memory_points(list(targets.values()), cfg.grid.tokens, reached, cal.cost)
    record["memory_targets"] = targets
    dev = torch.device(cfg.device)
    if not wanted or dev.type != "cuda":
        record["memory_points_not_measured"] = [list(bs) for bs in wanted]
        cal.extra["grid"].update(record)
        return cal
    once = replace(cfg.grid, warmup=0, repeats=1, packs=())
    mem, _ = measure_grid(model, wanted, dev, once, cfg.seed, progress=progress, timer=timer)
    return _fit(cfg, get_config(cfg.model), dev, measured, mix, capacity, model, record, mem)


def _fit(
    cfg: CalibrationConfig, arch: WanConfig, dev: torch.device, points: list[dict[str, Any]],
    mix: TokenMix, capacity: float, model: WanModel, grid_record: dict[str, Any],
    memory_points: list[dict[str, Any]] | None = None,
) -> Calibration:
    """The measured points fitted into a calibration file, with how they were measured."""
    setup = analytic.TrainingSetup(
        compute_bytes=analytic.compute_bytes(dev.type),
        activation_checkpointing=cfg.activation_checkpointing,
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
    grid = cfg.grid
    return fit_points(
        arch, device_name(str(dev)), points, mix, capacity, cfg.budgets, setup,
        count_parameters(model), memory_measured=dev.type == "cuda", max_loo=cfg.max_loo,
        memory_points=memory_points,
        extra={
            "provenance": measurement_provenance(str(dev)),
            "setup": setup_dict(setup, "bf16 autocast" if dev.type == "cuda" else "fp32"),
            "grid": {"batch_sizes": sorted(set(grid.batch_sizes)),
                     "tokens": sorted(set(grid.tokens)), "repeats": grid.repeats,
                     "warmup": grid.warmup, "process_warmup_steps": PROCESS_WARMUP_STEPS,
                     "timing": TIMING, "statistic": "min over passes",
                     "max_batch_tokens": grid.max_batch_tokens,
                     "packs": [{"name": p.name, "tokens": list(p.tokens)} for p in grid.packs],
                     **grid_record},
            "notes": notes,
        },
    )
