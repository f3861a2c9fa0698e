"""How long one Ulysses all-to-all takes on this device, against bytes and degree: the `comm`
section of a calibration (docs/calibration.md, communication).

Model of one all-to-all at degree d, n = bytes each rank holds before the exchange (it keeps
n/d and sends n(d-1)/d):

    t(d, n) = latency_s(d) + n·(d-1)/d / bytes_per_s(d)

`measure_points` times `torch.distributed.all_to_all_single` of an n-byte buffer split evenly
over the group, at every degree the caller built groups for (aligned blocks of d ranks,
`training.sp_groups`) and every size of the grid: all groups of a degree exchange at once, as
the SP groups of one training step do; per call the slowest rank of the world sets the time
(an all-reduce MAX), and a point's time is the median of those over the timed calls.
`fit_links` fits latency and bandwidth per degree by least squares of seconds on n·(d-1)/d;
`comm_section` is the dict, `with_comm` the calibration file with it.

The buffer is uint8: an all-to-all moves bytes whatever their dtype, and gloo exchanges
uint8 where it lacks bf16 kernels; `dtype_bytes` records the activation element size training
uses on the device (`model.analytic.compute_bytes`), for the cost model's bytes of a shard.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adaptiveload.calibration.settings import CommGrid
from adaptiveload.costmodel import Calibration, shipped_calibrations
from adaptiveload.errors import UserError
from adaptiveload.io import read_json, write_json
from adaptiveload.model.analytic import compute_bytes
from adaptiveload.provenance import measurement_provenance

TIMING = (
    "all_to_all_single of an n-byte uint8 buffer split evenly over the group, every group of "
    "the degree at once; `warmup` calls, then `repeats` calls each after a world barrier, timed "
    "by CUDA events (CUDA) or the wall clock (CPU); per call the slowest rank of the world; a "
    "point's seconds: the median over calls"
)


def sent_bytes(degree: int, n: float) -> float:
    """The bytes a rank sends in one all-to-all of `n` bytes over `degree` ranks: n·(d-1)/d."""
    return n * (degree - 1) / degree


def _one_call(recv: torch.Tensor, send: torch.Tensor, group: Any) -> float:
    """Seconds of one synchronised all_to_all_single on this rank."""
    if send.is_cuda:
        torch.cuda.synchronize(send.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_to_all_single(recv, send, group=group)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    dist.all_to_all_single(recv, send, group=group)
    return time.perf_counter() - t0


def time_all_to_all(group: Any, n: int, device: torch.device, grid: CommGrid) -> float:
    """The seconds of one all-to-all of `n` bytes per rank in `group` (this rank's): the
    median over `grid.repeats` calls of the slowest rank's time (every rank of the world
    calls this with the same arguments, its own group)."""
    send = torch.ones(n, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    for _ in range(grid.warmup):
        dist.all_to_all_single(recv, send, group=group)
    times = []
    for _ in range(grid.repeats):
        dist.barrier()
        times.append(_one_call(recv, send, group))
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(statistics.median(slowest.cpu().tolist()))


def measure_points(
    groups: Mapping[int, Any], grid: CommGrid, device: torch.device,
    report: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """{degree, bytes, seconds} of every degree of `groups` (degree -> this rank's process
    group) and every size of `grid`, a size cut down to a multiple of its degree (the even
    split). Collective: every rank of the world calls it with the same degrees and grid.
    `report` gets one progress line per point."""
    points = []
    for degree in sorted(groups):
        for size in grid.byte_sizes:
            n = size // degree * degree
            if n == 0:
                raise UserError(f"--sizes {size}: below degree {degree}; give sizes >= {degree}")
            seconds = time_all_to_all(groups[degree], n, device, grid)
            points.append({"degree": degree, "bytes": n, "seconds": seconds})
            if report:
                report(f"comm: degree {degree}, {n} bytes per rank: {seconds * 1e3:.4g} ms "
                       f"(median of {grid.repeats}, slowest rank)")
    return points


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, bool]:
    """(intercept, slope, clamped) of the least-squares line y = a + b·x with a >= 0: the
    unconstrained fit, or the fit through the origin where that one's intercept is negative
    (the constrained optimum then lies on a = 0)."""
    b, a = np.polyfit(x, y, 1)
    if a >= 0:
        return float(a), float(b), False
    return 0.0, float(x @ y / (x @ x)), True


def fit_links(points: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[dict]]:
    """Per degree, latency_s and bytes_per_s of the model by least squares of seconds on
    n·(d-1)/d (intercept kept >= 0), and per degree the fit's R^2, worst relative error and
    whether the latency was clamped. UserError where a degree has fewer than 2 sizes or its
    seconds do not grow with bytes (a non-positive slope: no bandwidth to speak of)."""
    links, fits = [], []
    for degree in sorted({int(p["degree"]) for p in points}):
        mine = [p for p in points if int(p["degree"]) == degree]
        x = np.array([sent_bytes(degree, p["bytes"]) for p in mine], dtype=np.float64)
        y = np.array([p["seconds"] for p in mine], dtype=np.float64)
        if len(set(x.tolist())) < 2:
            raise UserError(f"all-to-all at degree {degree}: needs >= 2 sizes to fit; add --sizes")
        latency, slope, clamped = _line(x, y)
        if not slope > 0:
            raise UserError(
                f"all-to-all at degree {degree}: seconds do not grow with bytes over "
                f"{int(x.min())}..{int(x.max())} bytes sent (slope {slope:.3g} s/B); measure "
                "larger --sizes or more --repeats"
            )
        pred = latency + slope * x
        ss = float(((y - y.mean()) ** 2).sum())
        links.append({"degree": degree, "latency_s": latency, "bytes_per_s": 1.0 / slope})
        fits.append({
            "degree": degree, "points": len(mine),
            "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 1.0,
            "max_rel_err": float(np.max(np.abs(pred - y) / y)),
            "latency_clamped_at_zero": clamped,
        })
    return links, fits


def comm_section(
    points: list[dict[str, Any]], backend: str, device: str, world_size: int, grid: CommGrid,
) -> dict[str, Any]:
    """The `comm` dict of a measurement: the spec's fields (source, backend, device,
    dtype_bytes, links, points), the fit's quality per degree, and how it was measured."""
    links, fits = fit_links(points)
    provenance = measurement_provenance(device)
    return {
        "source": "measured",
        "backend": backend,
        "device": provenance["device"],
        "dtype_bytes": compute_bytes(device),
        "links": links,
        "points": points,
        "fit": fits,
        "provenance": {
            **provenance, "world_size": world_size, "timing": TIMING,
            "sizes": list(grid.byte_sizes), "repeats": grid.repeats, "warmup": grid.warmup,
        },
    }


def read_target(calibration: Path, output: Path | None) -> tuple[dict[str, Any], Path]:
    """The calibration a `comm` section goes into, as its JSON (checked to be a calibration
    file), and the file to write: `output`, else the calibration itself (a shipped
    calibration, named, is read but only written to an `output`)."""
    path = calibration
    if not path.exists() and str(path) in shipped_calibrations():
        if output is None:
            raise UserError(f"{path}: a shipped calibration; give -o/--output for the new file")
        path = shipped_calibrations()[str(path)]
    data = read_json(path, "calibration file")
    Calibration.from_dict(data, str(path))
    return data, output or calibration


def with_comm(data: dict[str, Any], section: dict[str, Any], output: Path) -> None:
    """Write calibration `data` with its `comm` section set to `section` (atomically; every
    other field as it was)."""
    write_json(output, {**data, "comm": section})


def describe(section: Mapping[str, Any]) -> list[str]:
    """One line per degree of a `comm` section: its fitted latency and bandwidth."""
    label = f"{section['source']} ({section['device']}, {section['backend']})"
    return [
        f"comm {label}: degree {link['degree']}: latency {link['latency_s'] * 1e6:.4g} us, "
        f"{link['bytes_per_s'] / 1e9:.4g} GB/s (R^2 {fit['r2']:.3f}, worst point "
        f"{100 * fit['max_rel_err']:.1f}%)"
        for link, fit in zip(section["links"], section["fit"], strict=True)
    ]
