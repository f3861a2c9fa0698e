"""Additivity: is a packed micro-batch's cost the sum of its samples' terms?

The cost model prices any set of samples (`costmodel.CostModel.set_time`, `set_memory`):

    t(set) = max(t_floor, c0 + sum_i (c_seq + a*S_i + b*S_i^2))
    m(set) = m_static + sum_i (m_tok*S_i + m_seq)

but it is fitted on homogeneous (B, S) grid points, where sum_i S_i^2 is always B*S^2. A
named pack (`settings.Pack`) is samples of different lengths timed as ONE packed
micro-batch (`timing.measure_grid`, the packed path of the model); its relative error against
the prediction says whether the form holds for the mixed micro-batches a packing planner
makes. The packs are **held out of the fit**: they are the test of it. Fitted on, they
would let a cost the form lacks (a per-segment overhead of the packed path, attention that
does not stay within its segment) be absorbed into a and b, bending p and every budget of
the homogeneous batches too, and the check would then compare the fit with its own points.
docs/calibration.md says what a large error tells.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaptiveload.costmodel import CostModel

WHAT = (
    "packs of samples of different lengths, each timed as ONE packed forward+backward like a "
    "grid point (same passes, clock and statistic) and held out of the fit; predicted_s = "
    "cost.set_time(tokens), predicted_bytes = cost.set_memory(tokens); rel_err = "
    "|predicted - measured| / measured, signed_err = predicted / measured - 1"
)

# how a report names the calibration's timers (`settings.TIMERS` after `auto` is resolved)
CLOCKS = {"cpu": "thread CPU seconds", "wall": "wall-clock seconds"}


def held_out(
    cost: CostModel, packs: list[dict[str, Any]], memory_measured: bool, timer: str
) -> dict[str, Any] | None:
    """The `additivity` record of a calibration: each pack's measured `time_s` (and
    `peak_bytes` where memory is measured, i.e. on CUDA) beside the fitted cost's prediction
    and their relative errors, with the median and worst over the packs that ran. None
    without packs (a file without the field is a calibration that timed none)."""
    if not packs:
        return None
    rows = []
    for pack in packs:
        row = dict(pack, predicted_s=cost.set_time(pack["tokens"]),
                   predicted_bytes=cost.set_memory(pack["tokens"]))
        measured = pack.get("time_s")
        ran = pack.get("status") == "ok" and bool(measured)
        row["rel_err"] = abs(row["predicted_s"] / measured - 1) if ran else None
        row["signed_err"] = row["predicted_s"] / measured - 1 if ran else None
        peak = pack.get("peak_bytes") if memory_measured else None
        row["mem_rel_err"] = abs(row["predicted_bytes"] / peak - 1) if ran and peak else None
        rows.append(row)
    ran = [r for r in rows if r["rel_err"] is not None]
    worst = max(ran, key=lambda r: r["rel_err"], default=None)
    mem = np.array([r["mem_rel_err"] for r in ran if r["mem_rel_err"] is not None])
    return {
        "what": WHAT,
        "timer": timer,
        "memory_source": "measured" if memory_measured else "model",
        "num_packs": len(rows),
        "num_measured": len(ran),
        "median_rel_err": float(np.median([r["rel_err"] for r in ran])) if ran else None,
        "max_rel_err": worst["rel_err"] if worst else None,
        "worst_pack": worst["pack"] if worst else None,
        "mem_median_rel_err": float(np.median(mem)) if mem.size else None,
        "mem_max_rel_err": float(mem.max()) if mem.size else None,
        "packs": rows,
    }


def describe(additivity: dict[str, Any] | None) -> list[str]:
    """The additivity block of a report (`calibrate`, the device check's summary): a headline
    line, then one line per pack; nothing for a calibration without packs."""
    if not additivity:
        return []
    head = (
        f"additivity: {additivity['num_measured']} of {additivity['num_packs']} mixed packs "
        f"held out of the fit ({CLOCKS.get(additivity['timer'], additivity['timer'])})"
    )
    if additivity["num_measured"]:
        head += (
            f", |pred-meas|/meas median {100 * additivity['median_rel_err']:.1f}% worst "
            f"{100 * additivity['max_rel_err']:.1f}% ({additivity['worst_pack']})"
        )
    if additivity.get("mem_max_rel_err") is not None:
        head += (
            f"; memory median {100 * additivity['mem_median_rel_err']:.1f}% worst "
            f"{100 * additivity['mem_max_rel_err']:.1f}%"
        )
    lines = [head]
    for r in additivity["packs"]:
        segments = f"{_segments(r['tokens'])} = {r['sum_tokens']} tokens"
        if r["rel_err"] is None:
            lines.append(f"  {r['pack']}: {segments}: {r.get('status', 'not measured')}")
            continue
        line = (
            f"  {r['pack']}: {segments}: measured {r['time_s']:.4g} s, predicted "
            f"{r['predicted_s']:.4g} s ({100 * r['signed_err']:+.1f}%)"
        )
        if r["mem_rel_err"] is not None:
            line += (
                f"; peak {r['peak_bytes'] / 1e9:.3g} GB, predicted "
                f"{r['predicted_bytes'] / 1e9:.3g} GB ({100 * r['mem_rel_err']:.1f}%)"
            )
        lines.append(line)
    return lines


def _segments(tokens: list[int]) -> str:
    """A pack's token counts, longest first, repeats counted: '3740 + 221x2'."""
    lengths, counts = np.unique(np.asarray(tokens), return_counts=True)
    return " + ".join(f"{s}x{n}" if n > 1 else f"{s}"
                      for s, n in zip(lengths[::-1], counts[::-1], strict=True))
