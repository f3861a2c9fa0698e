"""Options several commands share, declared once: their flag, type, help and default live
here, so `plan`, `simulate` and `compare` say the same about the same input, and a command's
signature is one line per option."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from adaptiveload.data.bucketing import GRIDS, MODES
from adaptiveload.errors import UserError
from adaptiveload.planning.plan import STEP_MODES
from adaptiveload.planning.policies import POLICIES

Opt = typer.Option

Manifest = Annotated[Path, Opt(help="manifest CSV/Parquet (adaptiveload manifest ...)")]
Policy = Annotated[str, Opt(help=f"one of: {', '.join(POLICIES)}")]
Seed = Annotated[int, Opt(help="plan seed (with the epoch, seeds all shuffles)")]
Epoch = Annotated[int, Opt(help="epoch to plan")]
ValSplit = Annotated[
    str | None,
    Opt(help="the manifest's held-out split (data.val_split): its rows are not planned, as "
        "training leaves them out"),
]
Summary = Annotated[Path | None, Opt(help="plan summary JSON to write")]
Table = Annotated[Path | None, Opt("-o", "--output", help="plan table (Parquet) to write")]
SimulationSteps = Annotated[
    Path | None,
    Opt(help="also write the predicted per-(step, rank) table (Parquet; needs --calibration)"),
]
SimulationSummary = Annotated[
    Path | None, Opt(help="also write the simulation's run summary (JSON)")
]
WorldSize = Annotated[int, Opt(help="number of data-parallel ranks N")]
CalibrationFile = Annotated[
    Path | None,
    Opt(help="calibration JSON (or a shipped one by name, e.g. h200-wan2.1-t2v-1.3b): "
        "budgets set to 'auto' and the cost model"),
]
BudgetsFile = Annotated[
    Path | None,
    Opt("--budgets", help="budgets JSON of `adaptiveload budgets` (p and budgets derived for "
        "your data, its capacity): budgets set to 'auto'; the calibration still predicts"),
]
Strict = Annotated[
    bool,
    Opt("--strict", help="refuse an unusual plan (budget below every sample, excluded or "
        "oversize samples, heavy padding) instead of warning"),
]
MTok = Annotated[
    str, Opt(help="equal-token budget, tokens per batch (auto: calibration, else m_mem)")
]
MMem = Annotated[str, Opt(help="memory budget, tokens per batch (auto: calibration)")]
MComp = Annotated[
    str, Opt(help="compute budget, B*S^p per batch (auto: calibration's, at --p)")
]
P = Annotated[
    str,
    Opt(help="compute exponent in [1, 3] (auto: calibration); an auto --m-comp follows it, "
        "the calibration's reference batch kept (the p sweep)"),
]
MCompScale = Annotated[
    float, Opt(help="multiply the calibration's M_comp (auto --m-comp only; the M_comp sweep)")
]
PackTokens = Annotated[
    float | None,
    Opt(help="adaptiveload-packed: at most this many tokens per pack (default: packs fill "
        "toward the memory budget, M_mem as predicted memory with a calibration)"),
]
Bucketing = Annotated[str, Opt(help=" | ".join(MODES))]
Grid = Annotated[str, Opt(help=" | ".join(GRIDS))]
MaxFrames = Annotated[int, Opt(help="frames cap of the bucket grid")]
ShortClips = Annotated[
    str,
    Opt(help="clips below the grid's first video rung: still (train as 1-frame stills, with "
        "a warning) | video (keep their own 4k+1 frames)"),
]
WindowSteps = Annotated[int, Opt(help="balanced dealing window in steps (0 = whole epoch)")]
StepsPerEpoch = Annotated[
    str,
    Opt(help="free (the policy's own step count) | match (equal-token's for these samples "
        "and ranks) | an integer: optimizer steps per epoch"),
]
Model = Annotated[str | None, Opt(help="refuse a calibration made for another model")]
AllreduceGbps = Annotated[
    float, Opt(help="ring all-reduce bandwidth, Gbit/s (predicted metrics)")
]
Experiment = Annotated[str | None, Opt(help="experiment name for the simulation summary")]


def step_mode(value: str) -> str | int:
    """--steps-per-epoch as `PlanConfig` takes it: free, match or a step count."""
    if value in STEP_MODES:
        return value
    try:
        return int(value)
    except ValueError:
        raise UserError(
            f"--steps-per-epoch {value!r}: expected {' | '.join(STEP_MODES)} or an integer >= 1"
        ) from None
