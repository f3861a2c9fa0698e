"""The resolved settings of one calibration, built from a validated experiment dict
(`CalibrationConfig.from_experiment`) or field by field; frozen, like `training.settings`.

Grouped by what they decide:

- `Grid`: which points are timed and how often: the (B, S) bucket shapes of
  `grid.build_grid`, and the named `Pack`s of samples of different lengths, each timed as one
  packed micro-batch and held out of the fit (`timing.measure_grid`, `additivity`);
- `TokenMixSource`: the samples the budgets must serve (a manifest, a named mixture, else
  the grid's own sizes);
- `BudgetRules`: capacity, headroom and the reference batch the budgets are derived with
  (`costmodel.derive_budgets`); the same for a measurement, a refit and a prior;
- `PlanValidation`: the planned micro-batches timed against the fit after it;
- `CalibrationConfig`: all of them, plus the model, device, clock and fit checks of a
  measurement (`measure.calibrate`);
- `CommGrid`: the all-to-all sizes and passes of a communication calibration (`comm`).

Defaults are the experiment schema's (`experiment.schema_default`), so a field left out of
an experiment file and one left out of a constructor call agree. Nothing here imports torch:
the workflow reads the thread rule (`CalibrationConfig.job_threads`) while building its DAG.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptiveload.calibration.grid import latent_grid, validate_grid
from adaptiveload.costmodel import DEFAULT_HEADROOM
from adaptiveload.data.bucketing import DEFAULT_MAX_FRAMES, DEFAULT_MODE, GRIDS, MODES
from adaptiveload.errors import UserError, int_list
from adaptiveload.experiment import schema_default
from adaptiveload.model.architectures import get_config

if TYPE_CHECKING:
    from adaptiveload.model.lora import LoraSpec

TIMERS = ("auto", "wall", "cpu")
DEVICES = ("cpu", "cuda")
# the released Wan 2.1 models, bucketed on Wan's own grid; every other config on the tiny one
RELEASED = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b")
PACK_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # the schema's pattern of calibration.packs[].name


def _section(name: str) -> Any:
    return schema_default(f"calibration.{name}")


@dataclass(frozen=True)
class Pack:
    """Samples of `tokens` S_1, S_2, ... tokens (at least two different lengths), timed as ONE
    packed micro-batch: each sample a latent grid of its S_i tokens (`grid.latent_grid`, the
    grid points' own shapes), all of them one token stream with attention per sample.

    A pack of one length would be the grid point (B, S) again; mixed lengths are what tests
    whether the cost of a set is the sum of its samples' terms (`additivity`)."""

    name: str
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        where = f"calibration pack {self.name!r}"
        if not PACK_NAME.match(self.name):
            raise UserError(f"{where}: a name is letters, digits, '_', '.' or '-'")
        if len(set(self.tokens)) < 2 or min(self.tokens) < 1:
            raise UserError(
                f"{where} tokens {list(self.tokens)}: expected samples of at least 2 different "
                "token counts >= 1 (a pack of one length is the grid point (B, S))"
            )
        for s in self.tokens:
            latent_grid(int(s))

    @classmethod
    def parse(cls, text: str) -> Pack:
        """A command line's NAME=S1,S2,... (`calibrate measure --pack`)."""
        name, sep, tokens = text.partition("=")
        if not sep or not name:
            raise UserError(
                f"--pack {text!r}: expected NAME=S1,S2,... (its samples' token counts), "
                "e.g. --pack mixed=1560,7200"
            )
        return cls(name.strip(), int_list(tokens, f"--pack {name}"))


def packs_of(entries: Sequence[Mapping[str, Any]]) -> tuple[Pack, ...]:
    """The `Pack`s of an experiment's `calibration.packs` entries ({name, tokens})."""
    return tuple(Pack(str(e["name"]), tuple(int(s) for s in e["tokens"])) for e in entries)


@dataclass(frozen=True)
class Grid:
    """The (B, S) points timed: B = 1 at every token size (and the mix's largest bucket),
    every batch size at every listed size, B > 1 points over `max_batch_tokens` dropped;
    `warmup` steps per point, then the minimum over `repeats` passes (docs/calibration.md).
    `packs` are timed in the same passes, each as one packed micro-batch, and held out of the
    fit: they check it (`additivity.held_out`)."""

    batch_sizes: tuple[int, ...] = tuple(_section("batch_sizes"))
    tokens: tuple[int, ...] = tuple(_section("tokens"))
    max_batch_tokens: int | None = _section("max_batch_tokens")
    repeats: int = _section("repeats")
    warmup: int = _section("warmup")
    packs: tuple[Pack, ...] = field(default_factory=lambda: packs_of(_section("packs")))

    def __post_init__(self) -> None:
        validate_grid(self.batch_sizes, self.tokens, self.repeats, self.warmup)
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise UserError(f"max_batch_tokens {self.max_batch_tokens}: expected >= 1")
        names = [p.name for p in self.packs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"packs named {', '.join(twice)} more than once: give each its name")


@dataclass(frozen=True)
class TokenMixSource:
    """Where the budgets' token range comes from: a manifest file, else a named synthetic
    mixture of `num_samples` (seed `seed`), else nothing (the grid's sizes stand in). `grid`
    None: Wan's bucket grid for the released models, the tiny one otherwise."""

    manifest: Path | None = None
    mixture: str | None = None
    num_samples: int = schema_default("simulate.num_samples")
    seed: int = 0
    bucketing: str = DEFAULT_MODE
    grid: str | None = None
    max_frames: int = DEFAULT_MAX_FRAMES

    def __post_init__(self) -> None:
        if self.bucketing not in MODES:
            raise UserError(f"bucketing {self.bucketing!r}: expected one of {', '.join(MODES)}")
        if self.grid is not None and self.grid not in GRIDS:
            raise UserError(f"grid {self.grid!r}: expected one of {', '.join(GRIDS)}")
        if self.num_samples < 1:
            raise UserError(f"num_samples {self.num_samples}: expected >= 1")

    def load(self, model: str) -> Any:
        """The `calibration.mix.TokenMix` of this source for `model`, or None without one."""
        from adaptiveload.calibration.mix import manifest_token_mix, mixture_token_mix

        grid = self.grid or ("wan" if model in RELEASED else "tiny")
        if self.manifest is not None:
            return manifest_token_mix(self.manifest, self.bucketing, grid, self.max_frames)
        if self.mixture is not None:
            return mixture_token_mix(self.mixture, self.num_samples, self.seed, self.bucketing,
                                     grid, self.max_frames)
        return None


@dataclass(frozen=True)
class BudgetRules:
    """How the budgets are derived: against `capacity_gb` of memory (None: the device's own:
    a CUDA device's, the measured files' for a refit, the rates' device for a prior) with
    `headroom` of it kept free, for the reference batch (`ref_tokens`, `ref_batch`; None: the
    heaviest bucket within M_mem at its memory-limited batch size)."""

    capacity_gb: float | None = None
    headroom: float = DEFAULT_HEADROOM
    ref_tokens: float | None = None
    ref_batch: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_gb is not None and not self.capacity_gb > 0:
            raise UserError(f"capacity {self.capacity_gb} GB: expected > 0")
        if not 0 <= self.headroom < 1:
            raise UserError(f"headroom {self.headroom}: expected 0 <= headroom < 1")

    def capacity_bytes(self, own: float | None) -> float:
        """The bytes to budget against: `capacity_gb`, else the device's `own`."""
        if self.capacity_gb is not None:
            return self.capacity_gb * 1e9
        if own is None:
            raise UserError("--capacity-gb is required on CPU (there is no device memory to read)")
        return float(own)


@dataclass(frozen=True)
class PlanValidation:
    """After the fit: time `micro_batches` drawn from every policy's plan at `world_size`
    ranks against the prediction (0: none); none predicted above `max_seconds` is drawn."""

    micro_batches: int = 0
    world_size: int = schema_default("simulate.world_size")
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.micro_batches < 0 or self.world_size < 1:
            raise UserError("--validate and --validate-world-size: expected >= 0 and >= 1")


@dataclass(frozen=True)
class CalibrationConfig:
    """One measurement of `model` on `device` (`measure.calibrate`).

    `timer` "cpu" counts the measuring thread's CPU seconds, which on a shared CPU machine
    with ONE thread is the work without the time spent waiting for a core; "wall" the wall
    clock; "auto": cpu on a CPU with one thread (unless `threads` > 1), wall on CUDA.
    `threads` None: one where the timer is cpu, else all cores. `max_loo` None: the device
    type's `fit.DEFAULT_MAX_LOO`."""

    model: str = schema_default("model.config")
    device: str = _section("device")
    grid: Grid = field(default_factory=Grid)
    mix: TokenMixSource = field(default_factory=TokenMixSource)
    budgets: BudgetRules = field(default_factory=BudgetRules)
    threads: int | None = _section("threads")
    timer: str = _section("timer")
    max_loo: float | None = _section("max_loo_error")
    activation_checkpointing: bool = schema_default("train.activation_checkpointing")
    # train.lora: time the step of a LoRA run (adapters' gradients and optimizer state only)
    lora: LoraSpec | None = None
    seed: int = 0
    validation: PlanValidation = field(default_factory=PlanValidation)

    def __post_init__(self) -> None:
        get_config(self.model)  # UserError naming the known configs
        if self.device not in DEVICES:
            raise UserError(f"device '{self.device}': expected 'cpu' or 'cuda'")
        self.clock()  # refuses a timer/threads pair that cannot measure

    def check_measurement(self) -> None:
        """UserError unless a measurement can give a result (a refit or a prior reads only
        the mix and the budget rules): a capacity where the device has none to read, a mix
        to plan the validated micro-batches from."""
        if self.device == "cpu" and self.budgets.capacity_gb is None:
            raise UserError("--capacity-gb is required on CPU (there is no device memory to read)")
        if self.validation.micro_batches and self.mix.manifest is None and not self.mix.mixture:
            raise UserError("--validate needs a --manifest or --mixture to plan micro-batches from")

    @classmethod
    def from_experiment(cls, exp: dict[str, Any]) -> CalibrationConfig:
        """The calibration an experiment's `model`, `data`, `calibration` and `train` sections
        ask for (a validated experiment: `experiment.load`, or Snakemake's config)."""
        from adaptiveload.model.lora import lora_spec  # torch, only when measuring

        cal, data = exp["calibration"], exp["data"]
        return cls(
            model=exp["model"]["config"],
            device=cal["device"],
            grid=Grid(batch_sizes=tuple(cal["batch_sizes"]), tokens=tuple(cal["tokens"]),
                      max_batch_tokens=cal["max_batch_tokens"], repeats=cal["repeats"],
                      warmup=cal["warmup"],
                      packs=packs_of(cal["packs"])),
            mix=TokenMixSource(
                manifest=Path(data["manifest"]) if data["manifest"] else None,
                mixture=None if data["manifest"] else data["mixture"],
                num_samples=data["num_samples"], bucketing=data["bucketing"],
                grid=data["grid"], max_frames=data["max_frames"],
            ),
            budgets=BudgetRules(capacity_gb=cal["capacity_gb"], headroom=cal["headroom"],
                                ref_tokens=cal["ref_tokens"], ref_batch=cal["ref_batch"]),
            threads=cal["threads"],
            timer=cal["timer"],
            max_loo=cal["max_loo_error"],
            # measure the step training runs: with its activation checkpointing or without
            activation_checkpointing=exp["train"]["activation_checkpointing"],
            # and of the weights it trains: a LoRA run's backward and optimizer are cheaper
            lora=lora_spec(exp["train"]["lora"]),
        )

    def clock(self) -> tuple[str, int | None]:
        """The timer `auto` stands for and the torch threads it needs (None: leave torch's
        setting, all cores); UserError for a pair that cannot measure."""
        if self.timer not in TIMERS:
            raise UserError(f"timer '{self.timer}': expected 'auto', 'wall' or 'cpu'")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads {self.threads}: expected >= 1")
        timer, threads = self.timer, self.threads
        if timer == "auto":
            timer = "cpu" if self.device == "cpu" and threads in (None, 1) else "wall"
        if timer == "cpu":
            if self.device == "cuda" or threads not in (None, 1):
                raise UserError("timer 'cpu' needs --device cpu and --threads 1")
            threads = 1
        return timer, threads

    def job_threads(self, all_cores: int) -> int:
        """The cores a calibration job takes (the workflow's `threads:`): the clock's threads,
        else the whole machine."""
        return self.clock()[1] or all_cores


KIB = 1024
# the bytes each rank holds before one all-to-all, by device: geometric, x4. On CUDA 64 KiB
# .. 64 MiB spans the latency-bound to the bandwidth-bound end of NVLink (a 1.3B block's q of
# 8k tokens in bf16 is 24 MiB); on CPU (gloo over loopback) 16 KiB .. 16 MiB, a run of seconds
# whose largest size still takes several times the latency (so the slope is the bandwidth).
COMM_SIZES = {
    "cuda": tuple(64 * KIB * 4**k for k in range(6)),
    "cpu": tuple(16 * KIB * 4**k for k in range(6)),
}


@dataclass(frozen=True)
class CommGrid:
    """What a communication calibration times (`comm.measure_points`): one all-to-all of
    each of `sizes` bytes per rank (empty: `COMM_SIZES[device]`) at every degree, `warmup`
    calls, then `repeats` timed calls whose median is the point's time."""

    device: str = "cpu"
    sizes: tuple[int, ...] = ()
    repeats: int = 10
    warmup: int = 3

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise UserError(f"device '{self.device}': expected 'cpu' or 'cuda'")
        if self.sizes and (min(self.sizes) < 1 or len(set(self.sizes)) < 2):
            raise UserError(
                f"--sizes {','.join(map(str, self.sizes))}: expected at least 2 different byte "
                "counts >= 1 (the fit has a latency and a bandwidth)"
            )
        if self.repeats < 1 or self.warmup < 0:
            raise UserError(
                f"--repeats {self.repeats} / --warmup {self.warmup}: expected >= 1 / >= 0"
            )

    @property
    def byte_sizes(self) -> tuple[int, ...]:
        """The sizes timed, ascending."""
        return tuple(sorted(set(self.sizes or COMM_SIZES[self.device])))
