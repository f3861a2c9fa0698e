"""What the pipeline's rules (Snakefile, workflow/rules/*.smk) and the package must agree on,
written once here and called from both: where an experiment's files go (`Layout`), the names
of sweep points (`variants`, `parse_variant`, `sweep_point`), the ranks a run may emulate
(`check_world_size`), the step modes training runs at (`train_variants`), the index of every
run the analysis reads (`run_index`) and the fields of the experiment each stage reads
(`STAGE_FIELDS`).

Layout of one experiment (one never overwrites another; README "Where results land"):

    results/<name>/                 everything of the experiment: config.yaml, data/,
                                    calibration/, plans/, runs/, sim/, kernel/, analysis/
    results/tables|figures          the published tables and figures of `default`
    results/<name>/tables|figures   ... of any other experiment
    logs/<name>/, benchmarks/<name>/  one log and one benchmark file per job

A path function called with Snakemake wildcards (``"{policy}"``) gives the rule's pattern, with
values the concrete path: the same function serves the rule and the command run by hand.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptiveload import experiment
from adaptiveload.errors import UserError

PUBLISHED_EXPERIMENT = "default"  # its tables and figures go to results/tables|figures
# in a run folder: the tracking records an unreachable store has not taken yet (while any are)
RUN_SPOOL = "tracking.spool.jsonl"


@dataclass(frozen=True)
class Layout:
    """The files of experiment `name`, relative to the working directory."""

    name: str

    @property
    def root(self) -> str:
        return f"results/{self.name}"

    @property
    def published(self) -> str:
        return "results" if self.name == PUBLISHED_EXPERIMENT else self.root

    @property
    def tables(self) -> str:
        return f"{self.published}/tables"

    @property
    def figures(self) -> str:
        return f"{self.published}/figures"

    @property
    def logs(self) -> str:
        return f"logs/{self.name}"

    @property
    def benchmarks(self) -> str:
        return f"benchmarks/{self.name}"

    @property
    def config(self) -> str:
        """The resolved experiment (defaults filled) that every stage reads."""
        return f"{self.root}/config.yaml"

    def view(self, stage: str, level: str = "") -> str:
        """A stage's view of the resolved experiment: the fields it reads (`STAGE_FIELDS`);
        `level`: a training variant's folder level (`variant_level`)."""
        return f"{self.root}/config/{level}{stage}.yaml"

    @property
    def calibration(self) -> str:
        return f"{self.root}/calibration/calibration.json"

    @property
    def manifest(self) -> str:
        """The synthesized manifest of the experiment's mixture (a user's own file stays put)."""
        return f"{self.root}/data/manifest.parquet"

    @property
    def describe(self) -> str:
        return f"{self.root}/data/describe.json"

    @property
    def owner(self) -> str:
        """The experiment file whose results these are (`check_owner`)."""
        return f"{self.root}/experiment_file"

    @property
    def store_ready(self) -> str:
        return f"{self.root}/tracking/store.ready"

    @property
    def tracking_check(self) -> str:
        """The end-of-run check: every training run's records in the store, its run FINISHED."""
        return f"{self.root}/tracking/check.json"

    @property
    def kernel_bench(self) -> str:
        return f"{self.root}/kernel/bench.csv"

    @property
    def map_points(self) -> str:
        return f"{self.root}/paper_map/points.csv"

    @property
    def map_summary(self) -> str:
        return f"{self.root}/paper_map/summary.json"

    @property
    def run_index(self) -> str:
        return f"{self.root}/analysis/run_index.json"

    @property
    def analysis(self) -> str:
        return f"{self.root}/analysis"

    def plan(self, policy: str, seed: int | str, level: str = "") -> str:
        """The summary of a training plan (what `train --plan` checks its plan against);
        `level`: its training variant's folder level (`variant_level`)."""
        return f"{self.root}/plans/{level}{policy}/seed{seed}.json"

    def run_dir(self, policy: str, seed: int | str, kernel: str, level: str = "") -> str:
        """A training run's folder: steps.parquet, summary.json, checkpoints/; `level`: its
        training variant's folder level (`variant_level`)."""
        return f"{self.root}/runs/{level}{policy}/seed{seed}/{kernel}"

    def sim_manifest(self, sim: str, mixture: str) -> str:
        return f"{self.root}/sim/{sim}/manifests/{mixture}.parquet"

    def sim_budgets(self, sim: str, mixture: str) -> str:
        """The budgets a simulate entry with its own `capacity_gb` plans with: its calibration's
        derived again for the mixture's samples at that capacity (`adaptiveload budgets`)."""
        return f"{self.root}/sim/{sim}/budgets/{mixture}.json"

    def sim_dir(self, sim: str, variant: str, policy: str, seed: int | str) -> str:
        """A simulation's folder: plan.json, steps.parquet, summary.json."""
        return f"{self.root}/sim/{sim}/{variant}/{policy}/seed{seed}"


# ---------------------------------------------------------------- stage views
# The fields of the resolved experiment each stage that takes `--config` reads (dotted paths;
# a section name stands for all of it). The pipeline hands each stage its view
# (`Layout.view`), a file that changes only when these fields do, so an edit elsewhere (the
# description, the analysis settings, a simulation) reruns no calibration or training; a
# stage that reads a field not listed fails at once (`experiment.load` keeps to the view).
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    # CalibrationConfig.from_experiment: the measured model, the token mix, the grid and
    # budget rules, whether training checkpoints activations and trains LoRA adapters (the
    # steps it times)
    "calibrate": ("name", "model.config", "data", "calibration",
                  "train.activation_checkpointing", "train.lora"),
    # training.settings.from_experiment, training.inputs.prepare_data (the policy, seed and
    # kernel come from the command line; the plan it must reproduce is an input file)
    "train": ("name", "model.config", "model.batch_layout", "model.init_from", "data",
              "budgets", "plan", "train", "calibration.device", "calibration.file"),
    "paper_map": ("name", "paper_map"),
}


def stage_view(config: dict[str, Any], stage: str, variant: str = "base") -> dict[str, Any]:
    """The content of `stage`'s view of the validated experiment `config` (`Layout.view`), for
    a training variant `variant` at its step mode (`at_variant`)."""
    return experiment.view(at_variant(config, variant), STAGE_FIELDS[stage])


# ---------------------------------------------------------------- sweep points
BASE_VARIANT = "base"
# a `sweeps:` axis of the experiment -> the name of its points, "<name>=<value>"
SWEEP_VARIANTS = {"p": "p", "m_comp_scale": "m_comp", "world_sizes": "world_size",
                  "mixtures": "mixture"}
# a training variant: the runs at a step mode of `train.step_modes` other than the plan's
STEP_MODE_AXIS = "steps_per_epoch"
_VALUES = {"p": r"[0-9.]+", "m_comp": r"[0-9.e+-]+", "world_size": r"\d+",
           "mixture": r"[A-Za-z0-9_.-]+"}
_VALUES[STEP_MODE_AXIS] = r"free|match|[1-9]\d*"
# every variant name (the `variant` wildcard of the rules)
VARIANT_PATTERN = "|".join([BASE_VARIANT, *(f"{n}=(?:{v})" for n, v in _VALUES.items())])


def variants(sweeps: dict[str, list[Any]]) -> list[str]:
    """"base" plus one variant per sweep point; each is planned and simulated for every
    policy and seed of every `simulate:` entry."""
    return [BASE_VARIANT] + [
        f"{name}={value}" for axis, name in SWEEP_VARIANTS.items() for value in sweeps[axis]
    ]


def parse_variant(variant: str) -> tuple[str, str]:
    """(axis name, value) of a sweep point, ("", "") for the base; UserError for anything else."""
    if not re.fullmatch(VARIANT_PATTERN, variant):
        raise UserError(f"variant {variant!r}: expected {BASE_VARIANT} or one of "
                        f"{', '.join(f'{n}=VALUE' for n in _VALUES)}")
    axis, _, value = variant.partition("=")
    return (axis, value) if value else ("", "")


@dataclass(frozen=True)
class SweepPoint:
    """How one variant of a `simulate:` entry is planned: its ranks and mixture, and the p or
    M_comp multiple the budgets are resolved at (None: the calibration's)."""

    world_size: int
    mixture: str
    p: float | None = None
    m_comp_scale: float | None = None


def sweep_point(sim: dict[str, Any], variant: str) -> SweepPoint:
    """The variant `variant` of the `simulate:` entry `sim`."""
    axis, value = parse_variant(variant)
    return SweepPoint(
        world_size=int(value) if axis == "world_size" else int(sim["world_size"]),
        mixture=value if axis == "mixture" else str(sim["mixture"]),
        p=float(value) if axis == "p" else None,
        m_comp_scale=float(value) if axis == "m_comp" else None,
    )


def steps_per_epoch(config: dict[str, Any], sim: dict[str, Any] | None = None) -> str | int:
    """The optimizer steps per epoch a plan of the validated experiment `config` is made at
    (`plan.steps_per_epoch`; a `simulate:` entry `sim` may set its own): what the plan
    stage's ``--steps-per-epoch`` gets and what training plans again."""
    own = sim.get("steps_per_epoch") if sim is not None else None
    return own if own is not None else config["plan"]["steps_per_epoch"]


# ---------------------------------------------------------------- training variants
def train_variants(config: dict[str, Any]) -> list[str]:
    """The variants every policy, seed and kernel of the validated experiment `config` trains
    at, one per step mode of `train.step_modes` (null: the plan's mode alone): the plan's
    own mode (`plan.steps_per_epoch`) is the base, any other "steps_per_epoch=<mode>", so
    the analysis compares the policies within each mode (a comparison group per variant)."""
    own = steps_per_epoch(config)
    modes = config["train"]["step_modes"] or [own]
    return [BASE_VARIANT if mode == own else f"{STEP_MODE_AXIS}={mode}" for mode in modes]


def at_variant(config: dict[str, Any], variant: str) -> dict[str, Any]:
    """The validated experiment `config` as the training variant `variant` runs it: its
    step mode in `plan.steps_per_epoch`, which the plan stage and training both read."""
    axis, value = parse_variant(variant)
    if axis != STEP_MODE_AXIS:
        return config
    mode: str | int = int(value) if value.isdigit() else value
    return {**config, "plan": {**config["plan"], "steps_per_epoch": mode}}


# The folder level of a training variant in its plan, view and run paths: none for the base
# (an experiment at one step mode keeps its paths), "<variant>/" else. The rules' `level`
# wildcard takes these values (the empty one included).
LEVEL_PATTERN = rf"(|{STEP_MODE_AXIS}=({_VALUES[STEP_MODE_AXIS]})/)"


def variant_level(variant: str) -> str:
    """The folder level of the training variant `variant` (`LEVEL_PATTERN`)."""
    return "" if variant == BASE_VARIANT else f"{variant}/"


def level_variant(level: str) -> str:
    """The training variant whose folder level is `level` (`variant_level` inverted)."""
    return level.removesuffix("/") or BASE_VARIANT


# ---------------------------------------------------------------- ranks
MAX_EMULATED_WORLD_SIZE = 1024  # train.world_size's maximum in the schema (a test checks)


def check_world_size(world_size: int, name: str = "world_size") -> int:
    """`world_size` if one process can emulate that many ranks; UserError naming `name` else."""
    if isinstance(world_size, bool) or not 1 <= world_size <= MAX_EMULATED_WORLD_SIZE:
        raise UserError(f"{name} {world_size}: must be between 1 and {MAX_EMULATED_WORLD_SIZE}")
    return world_size


# ---------------------------------------------------------------- the run index
def run_index(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run the analysis of a validated experiment reads: its training runs (measured)
    and simulations (model), each with its comparison group (`setup`), variant, files and
    the calibration whose capacity scales its memory (`analysis.aggregate.parse_index`)."""
    out = Layout(config["name"])
    runs = []
    for variant in train_variants(config) if config["train"]["enabled"] else []:
        for policy in config["policies"]:
            for seed in config["seeds"]:
                for kernel in config["model"]["kernels"]:
                    d = out.run_dir(policy, seed, kernel, variant_level(variant))
                    runs.append({"setup": "train", "variant": variant,
                                 "summary": f"{d}/summary.json", "steps": f"{d}/steps.parquet",
                                 "calibration": out.calibration})
    for sim in config["simulate"]:
        for variant in variants(config["sweeps"]):
            for policy in sim_policies(config, sim):
                for seed in sim_seeds(config, sim):
                    d = out.sim_dir(sim["name"], variant, policy, seed)
                    runs.append({"setup": f"sim/{sim['name']}", "variant": variant,
                                 "experiment": config["name"], "kernel": "none",
                                 "summary": f"{d}/summary.json", "steps": f"{d}/steps.parquet",
                                 "calibration": sim["calibration"]})
    return runs


def sim_policies(config: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    """The policies a `simulate:` entry plans: its own `policies`, else the experiment's."""
    return list(sim.get("policies") or config["policies"])


def sim_seeds(config: dict[str, Any], sim: dict[str, Any]) -> list[int]:
    """The seeds a `simulate:` entry plans: its own `seeds`, else the experiment's. A
    prediction has no sampling error, so a few seeds show what the data's draw changes;
    measured training needs more to resolve its effects (docs/measurement.md)."""
    return list(sim.get("seeds") or config["seeds"])


def all_policies(config: dict[str, Any]) -> list[str]:
    """Every policy the validated experiment `config` trains or simulates, in first-seen
    order (the rules' `policy` wildcard)."""
    found = [*config["policies"], *(p for sim in config["simulate"]
                                    for p in sim_policies(config, sim))]
    return list(dict.fromkeys(found))


def run_files(index: list[dict[str, Any]]) -> list[str]:
    """The files of the runs in `index` (the inputs of the analysis)."""
    return [path for run in index for path in (run["summary"], run["steps"])]


def experiment_file(files: list[str | Path], command_line: list[str | Path]) -> str:
    """Of the config files Snakemake layered (`files`: `command_line`'s `--configfile`s, then
    the Snakefile's `configfile:`, which they override), the experiment's: the last of the
    command line's that sets `name` (an overlay of a few fields does not), else the
    Snakefile's; as a path relative to the working directory when it lies under it (the
    form `check_owner` compares, whatever form the command line had)."""
    given = [str(f) for f in command_line]
    layered = [str(f) for f in files if str(f) not in given] + given  # by precedence
    named = [f for f in layered if "name" in (experiment.read_yaml(f) or {})]
    path = Path(named[-1] if named else layered[-1]).resolve()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def check_owner(
    config: dict[str, Any], files: list[str | Path], command_line: list[str | Path]
) -> str:
    """The experiment file of this run of the pipeline (`experiment_file`), refused
    (UserError) if `results/<name>` holds the results of another experiment file with the
    same `name`: the two would share that folder and the MLflow experiment `name`, each
    overwriting the other's outputs."""
    mine, name = experiment_file(files, command_line), config["name"]
    stamp = Path(Layout(name).owner)
    theirs = stamp.read_text().strip() if stamp.is_file() else mine
    if theirs != mine:
        raise UserError(
            f"{mine}: name: {name!r} is already the name of {theirs}, whose results are in "
            f"results/{name}/ and MLflow experiment {name!r}; give this experiment another "
            f"name (or, if {mine} now is that experiment, delete {stamp})"
        )
    return mine


# the files an experiment names that the user brings (none is made by a rule), with how to
# make each: (section, field, the fix)
USER_INPUTS = (
    ("data", "manifest", "make it from your cache with `adaptiveload manifest import FOLDER "
     "-o PATH` or point the field at your manifest (docs/finetune.md)"),
    ("data", "empty_text", "save the text encoder's output for \"\" there "
     "(adaptiveload.data.latents.save_text) or set data.caption_dropout: 0 and the field "
     "to null (docs/finetune.md)"),
    ("model", "init_from", "point it at your checkpoint (either layout) or set it to scratch "
     "(docs/models.md)"),
)


def check_user_inputs(config: dict[str, Any], experiment_file: str) -> None:
    """Refuse (UserError, one line naming the file, field and fix) a run whose user-brought
    input does not exist: no rule makes it, and Snakemake would otherwise stop on a rule's
    missing input several lines in, naming neither the field nor what to do."""
    for section, field, fix in USER_INPUTS:
        path = config[section].get(field)
        if path in (None, experiment.SCRATCH) or Path(path).exists():
            continue
        raise UserError(f"{experiment_file}: {section}.{field}: {path} does not exist; {fix}")
