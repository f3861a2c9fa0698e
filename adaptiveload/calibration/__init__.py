"""Measure how a Wan model's training step grows with B and S on this device; derive budgets.

`calibrate` (`measure`) times forward+backward micro-batches (`timing`) over a (B, S) grid of
bucket shapes (`grid.build_grid`: B = 1 at every size and at the manifest's largest bucket; a
process warm-up, per-point warm-up, then the minimum over >= 2 passes, spread recorded), records
peak memory where the device can report it (CUDA), fits the floored cost model with its
degeneracy checks (`fit.fit_measured`) and derives p, M_mem, M_comp and the equal-token
baseline's M_tok for a token mix (`mix`; rules in `costmodel.BUDGET_RULES`). On CPU there is no
measured memory: the memory coefficients come from the analytic model and the file says so
(`memory_source: model`). `validate.validate_plans` then times micro-batches drawn from the
policies' plans (`--validate K`); `files.refit` fits the points of existing measured files
again. docs/calibration.md has the why.

`prior` builds the same file from the analytic model and a device's rates instead of a timer
(`source: model`): the shipped H200 priors are made this way, reproducibly.

The modules, one job each: `mix` (token mixes), `grid` (which points, their shapes), `timing`
(timing the model), `fit` (the fitted forms and their checks), `files` (points to a calibration
file and back), `validate`, `prior`, `measure` (the whole measurement). Their public names are
re-exported here.
"""

from adaptiveload.calibration.files import calibration_record, fit_points, refit, setup_dict
from adaptiveload.calibration.fit import (
    ATTENTION_REQUIRED_SHARE,
    DEFAULT_MAX_LOO,
    FORMS,
    PINNED_SHARE,
    FitStats,
    fit,
    fit_measured,
    leave_one_out,
    required_terms,
)
from adaptiveload.calibration.grid import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_TOKENS,
    MAX_AXIS,
    MIN_PASSES,
    bucket_shape,
    build_grid,
    latent_grid,
    validate_grid,
)
from adaptiveload.calibration.measure import calibrate
from adaptiveload.calibration.mix import (
    TokenMix,
    grid_token_mix,
    manifest_token_mix,
    mixture_token_mix,
    token_mix,
)
from adaptiveload.calibration.prior import PRIOR_BATCH_SIZES, PRIOR_SETUPS, prior
from adaptiveload.calibration.timing import (
    PROCESS_WARMUP_STEPS,
    TIMING,
    measure_grid,
    pass_spread,
    random_batch,
    timed,
    train_step,
    warm_up_process,
)
from adaptiveload.calibration.validate import draw_micro_batches, validate_plans

__all__ = [
    "ATTENTION_REQUIRED_SHARE", "DEFAULT_BATCH_SIZES", "DEFAULT_MAX_LOO", "DEFAULT_TOKENS",
    "FORMS", "MAX_AXIS", "MIN_PASSES", "PINNED_SHARE", "PRIOR_BATCH_SIZES", "PRIOR_SETUPS",
    "PROCESS_WARMUP_STEPS", "TIMING", "FitStats", "TokenMix", "bucket_shape", "build_grid",
    "calibrate", "calibration_record", "draw_micro_batches", "fit", "fit_measured", "fit_points",
    "grid_token_mix", "latent_grid", "leave_one_out", "manifest_token_mix", "measure_grid",
    "mixture_token_mix", "pass_spread", "prior", "random_batch", "refit", "required_terms",
    "setup_dict", "timed", "token_mix", "train_step", "validate_grid", "validate_plans",
    "warm_up_process",
]  # fmt: skip
