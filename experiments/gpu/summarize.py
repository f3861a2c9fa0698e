"""The headline numbers of one `experiments/gpu/h200.sh` run, as text and JSON.

Reads what the run wrote under OUTDIR (steps.tsv, env.json, dist/, kernel/summary.txt, the
calibration JSON, comm/, train/*/summary.json) and writes OUTDIR/summary.txt and summary.json:
the 2-process check, the kernel's target table as kernel_check printed it, the fit (p, R^2,
M_mem, M_comp), the mixed packs held out of it (additivity: measured vs predicted time and
memory, median and worst), the all-to-all's latency and bandwidth per degree (or why it was
not measured), and per training run imbalance / idle / throughput / VRAM next to the
equal-token run of the same kernel and the paper's 39% -> 18.9%, +22.7%, +27.2%, with the
imbalance the cost model predicts for the very micro-batches each run timed. Missing parts
are reported as missing.

    python experiments/gpu/summarize.py OUTDIR
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

POINT_KEYS = ("batch", "tokens", "time_s", "peak_bytes")
PACK_KEYS = ("pack", "tokens", "samples", "sum_tokens", "status", "time_s", "predicted_s",
             "rel_err", "signed_err", "peak_bytes", "predicted_bytes", "mem_rel_err")
PAPER = "paper: imbalance 39% -> 18.9%, peak VRAM utilization +22.7%, throughput +27.2% (16 GPUs)"


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def calibration_summary(out: Path) -> dict[str, Any] | None:
    files = sorted((out / "calibration").glob("*.json"))
    cal = _json(files[0]) if files else None
    if cal is None:
        return None
    points = cal.get("points", [])
    ok = [p for p in points if p.get("status") == "ok"]
    largest = max(ok, key=lambda p: (p["tokens"], p["batch"]), default=None)
    fit = cal.get("fit", {})
    return {
        "file": str(files[0].relative_to(out)),
        "label": f"{cal['source']} ({cal['device']})",
        "p": cal["p"],
        "p_unclamped": cal.get("budgets", {}).get("p_unclamped"),
        "r2": fit.get("r2"),
        "max_rel_err": fit.get("max_rel_err"),
        "mem_r2": fit.get("mem_r2"),
        "m_mem": cal["m_mem"],
        "m_comp": cal["m_comp"],
        "ref": [cal.get("budgets", {}).get("ref_batch"), cal.get("budgets", {}).get("ref_tokens")],
        "points_ok": len(ok),
        "points_oom": sum(p.get("status") == "oom" for p in points),
        "largest_point": {k: largest.get(k) for k in POINT_KEYS} if largest else None,
        "additivity": additivity_summary(cal),
    }


def additivity_summary(cal: dict[str, Any]) -> dict[str, Any] | None:
    """The calibration's mixed packs held out of the fit (`additivity`): median and worst
    relative error of the cost of a set, and each pack's measured and predicted time (and
    memory); None for a calibration that timed no packs."""
    add = cal.get("additivity")
    if not add:
        return None
    rows = [{k: r.get(k) for k in PACK_KEYS} for r in add.get("packs", [])]
    return {**{k: v for k, v in add.items() if k != "packs"}, "packs": rows}


def predicted_imbalance(steps_file: Path, calibration: Path, warmup: int) -> float | None:
    """Imbalance of the run's timed steps as the calibration's cost model predicts it for the
    same (step, rank) micro-batches (`model`), to set beside the measured one."""
    import pandas as pd

    from adaptiveload import metrics
    from adaptiveload.costmodel import Calibration

    if not (steps_file.is_file() and calibration.is_file()):
        return None
    steps = pd.read_parquet(steps_file)
    steps = steps[steps["step"] >= warmup]
    if steps.empty:
        return None
    cost = Calibration.load(calibration).cost
    batch = steps["samples"].to_numpy()
    pred = cost.step_time(batch, steps["tokens"].to_numpy() / batch)
    table = steps.assign(pred=pred).pivot(index="step", columns="rank", values="pred")
    return metrics.imbalance_rate(table.to_numpy())


def dist_summary(out: Path) -> dict[str, Any] | None:
    """The 2-process torchrun check: launch mode, ranks and device of what it wrote."""
    s = _json(out / "dist" / "ddp" / "summary.json")
    if s is None:
        return None
    return {k: s.get(k) for k in ("launch_mode", "world_size", "device", "steps_total",
                                  "imbalance_rate", "samples_per_s")}


def comm_summary(out: Path) -> dict[str, Any] | None:
    """The all-to-all part: the `comm` section it wrote, or the reason it did not run on this
    machine (comm/skipped.txt); None where the part did not run at all."""
    skipped = out / "comm" / "skipped.txt"
    if skipped.is_file():
        return {"status": "not-applicable", "reason": skipped.read_text().strip()}
    files = sorted((out / "comm").glob("*.json"))
    comm = (_json(files[0]) or {}).get("comm") if files else None
    if comm is None:
        return None
    return {"status": "measured", "file": str(files[0].relative_to(out)),
            "world_size": comm.get("provenance", {}).get("world_size"),
            **{k: comm.get(k) for k in ("source", "backend", "device", "links", "fit")}}


def train_summaries(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted((out / "train").glob("*/summary.json")):
        s = _json(path) or {}
        rows.append({
            "run": path.parent.name,
            **{k: s.get(k) for k in (
                "policy", "kernel", "device", "steps_total", "warmup_steps", "imbalance_rate",
                "idle_fraction", "max_over_mean", "samples_per_s", "tokens_per_s",
                "vram_utilization_mean", "vram_utilization_max", "sim_rel_err_median",
                "calibration",
            )},
        })
        rows[-1]["imbalance_predicted"] = predicted_imbalance(
            path.parent / "steps.parquet", out / "train" / "calibration-train.json",
            int(s.get("warmup_steps") or 0),
        )
    base = {r["kernel"]: r for r in rows if r["policy"] == "equal-token"}
    eager = {r["policy"]: r for r in rows if r["kernel"] == "eager"}
    for r in rows:
        b, e = base.get(r["kernel"]), eager.get(r["policy"])
        if b and b["samples_per_s"] and r["samples_per_s"]:
            r["throughput_vs_equal_token"] = r["samples_per_s"] / b["samples_per_s"] - 1
        if b and b.get("vram_utilization_mean") and r.get("vram_utilization_mean"):
            r["vram_util_vs_equal_token"] = (
                r["vram_utilization_mean"] / b["vram_utilization_mean"] - 1
            )
        if r["kernel"] == "fused" and e and e["samples_per_s"] and r["samples_per_s"]:
            r["throughput_fused_vs_eager"] = r["samples_per_s"] / e["samples_per_s"] - 1
    return rows


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(summary: dict[str, Any], out: Path) -> str:
    lines = [f"H200 check: {summary['device']} | {summary['versions']}"]
    lines.append("parts: " + ", ".join(f"{k}={v}" for k, v in summary["parts"].items()))
    dist = summary.get("dist")
    lines.append("-- dist (torchrun --nproc-per-node 2, DDP over gloo, one device)")
    lines.append("missing" if dist is None else
                 f"{dist['launch_mode']} x {dist['world_size']} on {dist['device']}: "
                 f"{dist['steps_total']} steps, imbalance {_num(dist['imbalance_rate'], '.3f')}")
    kernel = out / "kernel" / "summary.txt"
    lines.append("-- kernel (experiments/gpu/kernel_check.sh)")
    if kernel.is_file():
        lines.extend(kernel.read_text().splitlines())
    elif not kernel.parent.is_dir():
        lines.append("not run")
    else:
        bench = out / "kernel" / "bench.csv"
        rows = list(csv.DictReader(bench.open())) if bench.is_file() else []
        measured = sum(r.get("source") == "measured" for r in rows)
        lines.append(f"missing (kernel_check cut short?); bench.csv: {measured} measured rows")
    cal = summary["calibration"]
    lines.append("-- calibration")
    if cal is None:
        lines.append("missing")
    else:
        big = cal["largest_point"] or {}
        lines.append(
            f"{cal['label']}: p={cal['p']:.3f} (unclamped {_num(cal['p_unclamped'], '.3f')}) "
            f"R^2={_num(cal['r2'], '.4f')} worst {_pct(cal['max_rel_err'])} "
            f"mem R^2={_num(cal['mem_r2'], '.4f')} M_mem={cal['m_mem']:.4g} "
            f"M_comp={cal['m_comp']:.4g} ref B x S={cal['ref']}; points ok/oom="
            f"{cal['points_ok']}/{cal['points_oom']}; largest B={big.get('batch')} "
            f"S={big.get('tokens')}: {_num(big.get('time_s'), '.2f')} s, "
            f"{_num((big.get('peak_bytes') or 0) / 1e9, '.1f')} GB"
        )
        from adaptiveload.calibration.additivity import describe

        lines.extend(describe(cal["additivity"]) or ["additivity: no packs in this calibration"])
    comm = summary.get("comm")
    lines.append("-- comm (calibrate comm: all-to-all on every visible GPU)")
    if comm is None or comm["status"] != "measured":
        lines.append("missing" if comm is None else f"not-applicable: {comm['reason']}")
    else:
        from adaptiveload.calibration.comm import describe as describe_comm

        lines.extend(f"{comm['world_size']} processes, {line}" for line in describe_comm(comm))
    lines.append("-- training (16 emulated ranks; metrics over steps after warm-up)")
    lines.append(
        "run | timed steps | imbalance measured/predicted | idle | samples/s | tokens/s | "
        "vram mean/max | thr vs equal-token | vram vs equal-token | fused vs eager | sim err"
    )
    for r in summary["train"]:
        measured = (r["steps_total"] or 0) - (r["warmup_steps"] or 0)
        lines.append(
            f"{r['run']} | {measured} | {_num(r['imbalance_rate'], '.3f')}/"
            f"{_num(r['imbalance_predicted'], '.3f')} | "
            f"{_num(r['idle_fraction'], '.3f')} | {_num(r['samples_per_s'], '.2f')} | "
            f"{_num(r['tokens_per_s'], '.0f')} | {_num(r['vram_utilization_mean'], '.3f')}/"
            f"{_num(r['vram_utilization_max'], '.3f')} | "
            f"{_pct(r.get('throughput_vs_equal_token'))} | "
            f"{_pct(r.get('vram_util_vs_equal_token'))} | "
            f"{_pct(r.get('throughput_fused_vs_eager'))} | {_num(r['sim_rel_err_median'], '.3f')}"
        )
    if not summary["train"]:
        lines.append("missing")
    lines.append(PAPER)
    return "\n".join(lines) + "\n"


def main(out: Path) -> int:
    env = _json(out / "env.json") or {}
    parts: dict[str, str] = {}
    steps = out / "steps.tsv"
    if steps.is_file():
        for row in csv.DictReader(steps.open(), delimiter="\t"):
            parts[row["part"]] = f"{row['status']}/{row['seconds']}s"
    summary = {
        "device": env.get("device"),
        "versions": {k: v for k, v in (env.get("versions") or {}).items() if v},
        "torch_cuda": env.get("torch_cuda"),
        "parts": parts,
        "dist": dist_summary(out),
        "calibration": calibration_summary(out),
        "comm": comm_summary(out),
        "train": train_summaries(out),
        "paper": PAPER,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.txt").write_text(render(summary, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
