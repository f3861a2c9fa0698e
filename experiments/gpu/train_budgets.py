"""Budgets for a short measured training run, from a measured calibration.

The paper-scale budgets of a calibration (M_mem of a whole 141 GB H200: ~200k tokens per
micro-batch) make one emulated 16-rank step of the 1.3B take minutes; a device check has
about two. This derives the budgets for a *pretend capacity*, as the CPU default experiment
does with `capacity_gb: 0.15`: the capacity at which M_mem is `--fill` times the longest
bucket of the training data (so it still fits alone at B = 1). p, M_comp and M_tok then
follow the calibration's own rules (`derive_budgets`) on the training data's token mix: the
longest bucket at B = 1 is the reference batch of both policies, so with `--fill 1` M_mem
binds before M_comp everywhere and AdaptiveLoad's batches equal equal-token's; the default
1.5 leaves AdaptiveLoad room to grow short-bucket batches. The cost and memory model stay
the measured ones. The capacity comes from `costmodel.capacity_for` (as `adaptiveload budgets
--m-mem` prints it). The output is a calibration file for `adaptiveload train --calibration`,
labelled with what was changed.

    python experiments/gpu/train_budgets.py --calibration CAL.json --config EXP.yaml -o OUT.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from adaptiveload import experiment
from adaptiveload.calibration.mix import mixture_token_mix
from adaptiveload.costmodel import Calibration, capacity_for, derive_budgets
from adaptiveload.errors import UserError
from adaptiveload.io import write_json


def scaled(cal: Calibration, exp: dict, fill: float) -> Calibration:
    """`cal` with capacity and budgets for the experiment's data at M_mem = fill * S_max."""
    data = exp["data"]
    if not data.get("mixture") or data.get("manifest"):
        raise UserError("experiment data: a named `mixture` is expected (no manifest)")
    if fill < 1:
        raise UserError(f"--fill {fill}: must be >= 1 (the longest bucket must fit alone)")
    mix = mixture_token_mix(
        data["mixture"], data["num_samples"], 0, data["bucketing"], data["grid"],
        data["max_frames"],
    )
    headroom = cal.headroom
    m_mem = fill * float(mix.tokens.max())
    capacity = capacity_for(cal.cost, m_mem, headroom, float(mix.tokens.min()))
    budgets = derive_budgets(cal.cost, mix.tokens, capacity, headroom)
    note = (
        f"budgets for a pretend capacity of {capacity / 1e9:.2f} GB (M_mem = {fill:g} x the "
        f"longest training bucket, {int(mix.tokens.max())} tokens) so that a short emulated "
        "run fits a device check; the cost and memory model are the measured ones of "
        f"{cal.label}, whose paper-scale budgets were p={cal.p:.3f} M_mem={cal.m_mem:.4g} "
        f"M_comp={cal.m_comp:.4g}"
    )
    extra = dict(cal.extra)
    extra["budgets"] = budgets.to_dict()
    extra["manifest"] = mix.to_dict()
    extra["notes"] = [*cal.extra.get("notes", []), note]
    extra["paper_scale_budgets"] = {
        "p": cal.p, "m_mem": cal.m_mem, "m_comp": cal.m_comp, "m_tok": cal.m_tok,
        "capacity_bytes": cal.capacity_bytes,
    }
    return replace(
        cal, p=budgets.p, m_mem=budgets.m_mem, m_comp=budgets.m_comp, m_tok=budgets.m_tok,
        capacity_bytes=capacity, extra=extra,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True, help="the training experiment")
    parser.add_argument("--fill", type=float, default=1.5, help="M_mem / longest bucket")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        cal = Calibration.load(args.calibration)
        exp = experiment.load(args.config)
        if cal.model != exp["model"]["config"]:
            raise UserError(
                f"{args.calibration}: calibration is for {cal.model!r}, the experiment trains "
                f"{exp['model']['config']!r}"
            )
        out = scaled(cal, exp, args.fill)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_json(args.output, out.to_dict())
    print(
        f"{args.output}: p={out.p:.3f} M_mem={out.m_mem:.4g} M_comp={out.m_comp:.4g} "
        f"(ref bucket {out.extra['budgets']['ref_tokens']:.0f} tokens x "
        f"{out.extra['budgets']['ref_batch']})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
