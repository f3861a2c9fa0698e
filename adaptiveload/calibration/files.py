"""From fitted points to a calibration file and back: `fit_points` turns measured points into
a `Calibration` (fit, budgets, provenance), `refit` pools the points of existing measured files
and fits them again by today's rules."""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from adaptiveload.calibration.additivity import held_out
from adaptiveload.calibration.fit import (
    DEFAULT_MAX_LOO,
    fit_measured,
    fit_memory,
    required_terms,
)
from adaptiveload.calibration.mix import TokenMix
from adaptiveload.calibration.settings import BudgetRules
from adaptiveload.calibration.timing import pass_spread
from adaptiveload.costmodel import Calibration, CostModel, derive_budgets
from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.architectures import WanConfig, get_config
from adaptiveload.model.wan import build_on_meta, count_parameters


def fit_points(
    cfg: WanConfig, device: str, points: list[dict[str, Any]], mix: TokenMix, capacity: float,
    rules: BudgetRules, setup: analytic.TrainingSetup, num_params: int, memory_measured: bool,
    max_loo: float | None = None, extra: dict[str, Any] | None = None,
    memory_points: list[dict[str, Any]] | None = None,
) -> Calibration:
    """Fit measured points (`time_s`, and `peak_bytes` if `memory_measured`), derive budgets
    at `capacity` bytes by `rules` (headroom, reference batch).

    `memory_points` (measured memory up to the budgets, `grid.memory_points`) join the memory
    fit only: timed in one pass, they stay out of the time fit. They are kept in the file as
    `memory_points`, those out of memory with status "oom".

    The fit is `fit.fit_measured` (floored form, leave-one-out checked, refused when
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
    more = [p for p in memory_points or [] if p["status"] == "ok" and p.get("peak_bytes")]
    if memory_measured and more:
        both = [*ok, *more]
        terms, mem_r2, mem_worst = fit_memory(
            *(np.array([p[k] for p in both], dtype=np.float64) for k in ("batch", "tokens")),
            [p["peak_bytes"] for p in both],
        )
        cost = replace(cost, **terms)
        stats = replace(stats, mem_r2=mem_r2, mem_max_rel_err=mem_worst)
    if not memory_measured:
        m_static, m_tok, m_seq = analytic.memory_terms(cfg, num_params, setup)
        cost = replace(cost, m_static=m_static, m_tok=m_tok, m_seq=m_seq)
        for p in points:
            p["peak_bytes_model"] = float(cost.memory(p["batch"], p["tokens"]))
    loo = iter(stats.loo_rel_err or [])
    for p in ok:
        p["loo_rel_err"] = next(loo)
    budgets = derive_budgets(cost, mix.tokens, capacity, rules.headroom, rules.ref_tokens,
                             rules.ref_batch)
    if not 1.0 < budgets.p_unclamped < 2.0:
        raise UserError(
            f"derived p {budgets.p_unclamped:.3f} lies at or beyond the clamp [1, 2] over the "
            f"manifest's tokens {budgets.s_lo:.0f}..{budgets.s_hi:.0f}: the fitted per-sample "
            "cost does not bend like GEMMs plus attention there; add B = 1 points spanning "
            "that range"
        )
    return calibration_record(
        cfg, device, "measured", cost, budgets, capacity, rules.headroom, num_params, mix,
        extra={
            "memory_source": "measured" if memory_measured else "model",
            "fit": {**stats.to_dict(), "required_terms": list(required), "max_loo": max_loo},
            "points": points,
            **({"memory_points": memory_points} if memory_points else {}),
            **(extra or {}),
        },
    )


def refit(
    paths: Sequence[str | Path], mix: TokenMix, rules: BudgetRules | None = None,
    max_loo: float | None = None,
) -> Calibration:
    """Refit the points of measured calibration files with today's form, checks and budgets.

    Several files of the same model, device and setup are pooled: every pass of a (B, S)
    point counts, its time is the minimum over all of them (as in `measure_grid`) and its
    peak memory the maximum; the files' packs are pooled alike (by name and tokens) and held
    out of the fit again (`additivity.held_out` against the refitted cost). The budgets are
    derived for `mix` by `rules`, at its capacity or else the files' own; the provenance lists
    the source files and what their grids lacked by today's rules (docs/calibration.md).
    """
    rules = rules or BudgetRules()
    sources = _sources(paths)
    first = sources[0][1]
    timer = first.extra.get("grid", {}).get("timer", "wall")
    pooled = _pool([p for _, cal in sources for p in cal.extra["points"]], timer, _point_identity)
    packs = _pool([p for _, cal in sources for p in (cal.extra.get("additivity") or {}).get(
        "packs", [])], timer, _pack_identity)
    points = sorted(pooled.values(), key=lambda p: (p["batch"] * p["tokens"], p["batch"]))
    cfg = get_config(first.model)
    setup_info = first.extra.get("setup", {})
    setup = analytic.TrainingSetup(
        compute_bytes=analytic.compute_bytes(first.device),
        activation_checkpointing=bool(setup_info.get("activation_checkpointing")),
        shard_world_size=int(setup_info.get("shard_world_size", 1)),
    )
    memory_measured = first.extra.get("memory_source") == "measured"
    grids = [cal.extra.get("grid", {}) for _, cal in sources]
    lacking = []
    if any(g.get("warmup", 1) < 1 for g in grids):
        lacking.append("no per-point warm-up and no process warm-up (cold first points)")
    if any(g.get("max_batch_tokens") for g in grids):
        measured_b1 = {p["tokens"] for p in points if p["batch"] == 1 and p["status"] == "ok"}
        if int(mix.tokens.max()) not in measured_b1:
            lacking.append(
                f"B = 1 at the largest bucket ({int(mix.tokens.max())} tokens) was not measured "
                "(dropped by a batch-token cap): the reference bucket is extrapolated"
            )
    cal = fit_points(
        cfg, first.device, points, mix, rules.capacity_bytes(first.capacity_bytes), rules,
        setup, int(first.extra.get("num_params") or count_parameters(build_on_meta(cfg))),
        memory_measured=memory_measured, max_loo=max_loo,
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
    )
    additivity = held_out(cal.cost, list(packs.values()), memory_measured, timer)
    if additivity:
        cal.extra["additivity"] = additivity
    return cal


def _sources(paths: Sequence[str | Path]) -> list[tuple[str, Calibration]]:
    """The files to refit, each a measured calibration of one and the same setup."""
    if not paths:
        raise UserError("refit needs at least one measured calibration file")
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
    return sources


def _pool(
    records: list[dict[str, Any]], timer: str, identity: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Measured records of several files pooled by `identity` (the fields that say what was
    timed: a grid point's B and S, a pack's name and tokens): all passes of `timer` seconds
    (the minimum is its time, as in `measure_grid`), the largest peak memory, "ok" if any
    file ran it."""
    pooled: dict[str, dict[str, Any]] = {}
    for record in records:
        fields = identity(record)
        key = json.dumps(fields, sort_keys=True)
        into = pooled.setdefault(key, {
            **fields, "status": "oom", "peak_bytes": None, f"{timer}_s_passes": [],
        })
        passes = record.get(f"{timer}_s_passes") or []
        if record.get("status") == "ok" and passes:
            into["status"] = "ok"
            into[f"{timer}_s_passes"] += passes
            peak = record.get("peak_bytes")
            if peak is not None:
                into["peak_bytes"] = max(into["peak_bytes"] or 0.0, float(peak))
    for record in pooled.values():
        passes = record[f"{timer}_s_passes"]
        record["time_s"] = min(passes) if passes else None
        record[f"{timer}_s_median"] = statistics.median(passes) if passes else None
        record["spread"] = pass_spread(passes)
    return pooled


def _point_identity(point: dict[str, Any]) -> dict[str, Any]:
    return {"batch": int(point["batch"]), "tokens": int(point["tokens"])}


def _pack_identity(pack: dict[str, Any]) -> dict[str, Any]:
    fields = ("pack", "tokens", "samples", "sum_tokens", "latent_grids")
    return {k: pack[k] for k in fields if k in pack}


def setup_dict(setup: analytic.TrainingSetup, precision: str) -> dict[str, Any]:
    return {
        "precision": precision,
        "activation_checkpointing": setup.activation_checkpointing,
        "optimizer": "AdamW (fp32 states)",
        "shard_world_size": setup.shard_world_size,
    }


def calibration_record(
    cfg: WanConfig, device: str, source: str, cost: CostModel, budgets: Any, capacity: float,
    headroom: float, num_params: int, mix: TokenMix, extra: dict[str, Any],
) -> Calibration:
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
