"""Measure how a Wan model's training step grows with B and S on this device; derive budgets.

`measure.calibrate` times forward+backward micro-batches (`timing`) over a (B, S) grid of
bucket shapes (`grid.build_grid`: B = 1 at every size and at the manifest's largest bucket; a
process warm-up, per-point warm-up, then the minimum over >= 2 passes, spread recorded), records
peak memory where the device can report it (CUDA), fits the floored cost model with its
degeneracy checks (`fit.fit_measured`) and derives p, M_mem, M_comp and the equal-token
baseline's M_tok for a token mix (`mix`; rules in `costmodel.BUDGET_RULES`). On CPU there is no
measured memory: the memory coefficients come from the analytic model and the file says so
(`memory_source: model`). The grid's named packs (samples of different lengths, each timed as
one packed micro-batch in the same passes) are held out of the fit and compared with the cost
of a set (`additivity.held_out`). `validate.validate_plans` then times micro-batches drawn
from the policies' plans; `files.refit` fits the points of existing measured files again. `prior`
builds the same file from the analytic model and a device's rates instead of a timer
(`source: model`): the shipped H200 priors are made this way, reproducibly. docs/calibration.md
has the why.

The modules, one job each: `settings` (the frozen config of a calibration), `mix` (token
mixes), `grid` (which points, their shapes), `timing` (timing the model), `fit` (the fitted
forms and their checks), `files` (points to a calibration file and back), `additivity` (the
held-out packs against the fit), `validate`, `prior`, `measure` (the whole measurement),
`kernel_e2e` (the fused kernel end to end, on the same timed step). Import from the module (``from
adaptiveload.calibration.mix import mixture_token_mix``): like every package here, this one
re-exports nothing, so importing one job does not import the others (or torch).
"""
