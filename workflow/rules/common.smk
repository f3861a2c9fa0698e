# Shared helpers for the rules: paths and target lists derived from the validated config. Where
# an experiment's files go, the names of sweep points and the run index are the package's
# (adaptiveload.pipeline), so a command run by hand and the rules agree.
import os
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError

from adaptiveload import jobshell, pipeline
from adaptiveload.analysis.tables import kernel_measurements
from adaptiveload.io import json_text
from adaptiveload.calibration.settings import CalibrationConfig
from adaptiveload.errors import UserError
from adaptiveload.experiment import SCRATCH
from adaptiveload.planning.policies import POLICIES as POLICIES_BY_NAME

EXP = config["name"]
OUT = pipeline.Layout(EXP)
TABLES = OUT.tables
FIGS = OUT.figures
LOGS = OUT.logs
BENCH = OUT.benchmarks


envvars:
    "PATH",


# jobs find `adaptiveload` beside the Python running Snakemake (.venv/bin): no activation needed
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# Every shell job runs in `adaptiveload-job` (adaptiveload/jobshell.py): bash in a process group
# of its own that is ended when Snakemake ends, even by kill -9, so no job outlives it.
JOB_SHELL = os.path.join(os.path.dirname(sys.executable), "adaptiveload-job")
if not os.path.exists(JOB_SHELL):
    raise WorkflowError(f"{JOB_SHELL} not found: install the package (make setup) first")
shell.executable(JOB_SHELL)
# a job shell started just as Snakemake died is orphaned before it can ask for a signal: with
# this pid it sees that its parent is gone and starts nothing
os.environ[jobshell.PARENT_ENV] = str(os.getpid())
shell.prefix("set -euo pipefail; ")  # what Snakemake gives bash, which it finds by name only
# the same software as a conda environment, for `--software-deployment-method conda` (untested)
CONDA_ENV = "../envs/adaptiveload.yaml"

SEEDS = config["seeds"]
POLICIES = config["policies"]
KERNELS = config["model"]["kernels"]
TRAIN = config["train"]["enabled"]
SIMS = {s["name"]: s for s in config["simulate"]}
# the trained runs score a held-out validation set: the time-to-quality table and figure
VALIDATION = TRAIN and config["train"]["val_every"] > 0
SWEEPS = config["sweeps"]
# the step modes training runs at, as folder levels of their plans, views and runs ("" for the
# plan's own mode: adaptiveload.pipeline.train_variants, variant_level)
LEVELS = [pipeline.variant_level(v) for v in pipeline.train_variants(config)] if TRAIN else []

# timing jobs (calibrate, train) take the whole machine; Snakemake caps this at --cores
ALL_CORES = os.cpu_count() or 1


def calibration_threads():
    """The cores of the calibration job: the ones its clock needs (one on a CPU, where the
    timer counts that thread's CPU seconds), else the whole machine."""
    return CalibrationConfig.from_experiment(config).job_threads(ALL_CORES)


STORE = OUT.store_ready
CONFIG = OUT.config
VIEWS = {stage: OUT.view(stage) for stage in pipeline.STAGE_FIELDS}
CALIBRATION = OUT.calibration
MANIFEST = config["data"]["manifest"] or OUT.manifest
DESCRIBE = OUT.describe
KERNEL_BUILD = "build/kernels/build.json"
# the report's landing text: the workflow's description, then the headline numbers (rule landing)
REPORT_DESCRIPTION = os.path.join(workflow.basedir, "workflow", "report", "workflow.rst")
LANDING = os.path.abspath(f"{OUT.analysis}/landing.rst")
KERNEL_BENCH = [OUT.kernel_bench] if config["kernel"]["bench"] else []
PAPER_MAP = config["paper_map"]["enabled"]
MAP_POINTS = OUT.map_points
MAP_SUMMARY = OUT.map_summary


wildcard_constraints:
    policy="|".join(pipeline.all_policies(config)),
    seed=r"\d+",
    kernel="eager|fused",
    sim="|".join(SIMS) if SIMS else "NO_SIMULATION",
    variant=pipeline.VARIANT_PATTERN,
    level=pipeline.LEVEL_PATTERN,
    mixture=r"[A-Za-z0-9_.-]+",


def bucket_flags(section):
    """--bucketing/--grid/--max-frames of a config section (data or a simulate entry, whose
    null max_frames is the data's), as arguments: every value from a config reaches a job's
    shell as one quoted word (`{params.flags:q}` quotes each item of a list)."""
    frames = section.get("max_frames") or config["data"]["max_frames"]
    return ["--bucketing", section["bucketing"], "--grid", section["grid"], "--max-frames", frames]


def budget_flags():
    """Numeric budgets of the config override the calibration's ('auto' = take the
    calibration's; a null pack_tokens = none)."""
    flags = []
    for name, value in config["budgets"].items():
        if value not in ("auto", None):
            flags += [f"--{name.replace('_', '-')}", value]
    return flags


def init_files():
    """The files of model.init_from's checkpoint (weights, config.json), inputs of training:
    weights overwritten at the same path rerun it. Where they cannot be listed (no such path,
    no checkpoint there) the path itself, which Snakemake reports missing or training
    refuses in one line."""
    path = config["model"]["init_from"]
    if path == SCRATCH:
        return []
    from adaptiveload.training import finetune  # torch: only for a run from a checkpoint

    try:
        return [str(f) for f in finetune.checkpoint_files(path)]
    except UserError:
        return [path]


def val_split_flags():
    """--val-split of a manifest with a held-out split (data.val_split): the plan leaves its
    rows out, as training does."""
    split = config["data"]["val_split"]
    return ["--val-split", split] if split is not None else []


# ---------------------------------------------------------------- simulations and sweeps
def sim_manifest(wildcards):
    point = pipeline.sweep_point(SIMS[wildcards.sim], wildcards.variant)
    return OUT.sim_manifest(wildcards.sim, point.mixture)


def sim_budgets(wildcards):
    """The budgets file of a simulate entry with its own capacity_gb (none otherwise)."""
    sim = SIMS[wildcards.sim]
    if sim.get("capacity_gb") is None:
        return []
    return [OUT.sim_budgets(sim["name"], pipeline.sweep_point(sim, wildcards.variant).mixture)]


def sim_flags(wildcards):
    """The plan flags of one sweep point of one simulate entry. `adaptiveload plan` resolves
    the budgets of a p or M_comp point from the calibration (`Calibration.m_comp_at`), or
    reads those derived at the entry's own capacity_gb (`sim_budgets`)."""
    sim = SIMS[wildcards.sim]
    point = pipeline.sweep_point(sim, wildcards.variant)
    flags = [item for path in sim_budgets(wildcards) for item in ("--budgets", path)]
    flags += ["--world-size", point.world_size, *bucket_flags(sim)]
    flags += ["--allreduce-gbps", sim["allreduce_gbps"]]
    flags += ["--steps-per-epoch", pipeline.steps_per_epoch(config, sim)]
    if point.p is not None:
        flags += ["--p", point.p]
    if point.m_comp_scale is not None:
        flags += ["--m-comp-scale", point.m_comp_scale]
    return flags


# ---------------------------------------------------------------- the paper map
def map_calibrations():
    """Every calibration file the map's centre, axes and factorial name (inputs of the sweep)."""
    spec = config["paper_map"]
    files = {spec["centre"]["calibration"]}
    for section in (spec["axes"], spec["factorial"]):
        files.update(section.get("calibration") or [])
    return sorted(files)


# ---------------------------------------------------------------- figures and tables
def figure_names():
    names = ["mixture_tokens", "compute_heatmap", "imbalance_distribution", "throughput",
             "vram_utilization", "calibration_fit"]  # kernel_bandwidth: kernel.smk
    for axis, name in (("p", "p_sweep"), ("m_comp_scale", "m_comp_sweep"),
                       ("world_sizes", "world_size_scaling"), ("mixtures", "mixture_sweep")):
        if SWEEPS[axis]:
            names.append(name)
    if SIMS:
        names.append("load_vs_lower_bound")
    if any(POLICIES_BY_NAME[p].groups for p in pipeline.all_policies(config)):
        names.append("sp_groups")
    if VALIDATION:
        names.append("convergence")
    return names


def kernel_figure(wildcards=None):
    """The kernel's bandwidth figure where its benchmark measured something, else nothing (no
    figure of nothing: the kernel table says why); known once the benchmark ran."""
    if not KERNEL_BENCH:
        return []
    bench = checkpoints.kernel_bench.get().output[0]
    measured, _ = kernel_measurements(Path(bench))
    return [f"{FIGS}/kernel_bandwidth.png"] if measured is not None else []


def describe_input():
    """The manifest the mixture figure describes: training's, else the first simulation's."""
    if TRAIN:
        return MANIFEST
    sim = next(iter(SIMS.values()))
    return OUT.sim_manifest(sim["name"], sim["mixture"])


def describe_flags():
    return bucket_flags(config["data"] if TRAIN else next(iter(SIMS.values())))


TABLE_FILES = [f"{TABLES}/{t}.{ext}" for t in ("paper_table", "kernel_table")
               for ext in ("csv", "md", "html")] + [f"{TABLES}/headline.{ext}"
                                                     for ext in ("md", "html")]
CONVERGENCE_FILES = [f"{TABLES}/convergence.{ext}" for ext in ("csv", "md")] if VALIDATION else []


def run_dirs():
    """Every training run's folder (the tracking check's arguments)."""
    runs = [(lv, p, s, k) for lv in LEVELS for p in POLICIES for s in SEEDS for k in KERNELS]
    return [OUT.run_dir(p, s, k, lv) for lv, p, s, k in runs]


def step_mode(wildcards):
    """The steps per epoch of the training variant of a job's `level` wildcard."""
    variant = pipeline.level_variant(wildcards.level)
    return pipeline.steps_per_epoch(pipeline.at_variant(config, variant))


def all_targets():
    """Every file the pipeline writes, intermediates included: a job that fails has its
    outputs removed by Snakemake, and a missing intermediate that is not a target is not
    made again (the outputs after it look up to date), which would leave tables of stale
    runs and a plain rerun ending with "Nothing to be done"."""
    index = pipeline.run_index(config)
    targets = [OUT.owner, CONFIG, STORE, DESCRIBE, OUT.run_index, *pipeline.run_files(index),
               f"{OUT.analysis}/runs.parquet", f"{OUT.analysis}/steps.parquet",
               f"{TABLES}/stats.md", f"{OUT.analysis}/mlflow_analysis.json", *KERNEL_BENCH,
               LANDING,
               *TABLE_FILES, *CONVERGENCE_FILES,
               *[f"{FIGS}/{name}.png" for name in figure_names()]]
    targets += [OUT.sim_manifest(name, pipeline.sweep_point(sim, variant).mixture)
                for name, sim in SIMS.items() for variant in pipeline.variants(SWEEPS)]
    targets += [OUT.sim_budgets(name, pipeline.sweep_point(sim, variant).mixture)
                for name, sim in SIMS.items() for variant in pipeline.variants(SWEEPS)
                if sim.get("capacity_gb") is not None]
    if config["kernel"]["build"]:
        targets.append(KERNEL_BUILD)
    if PAPER_MAP:
        targets += [VIEWS["paper_map"], MAP_POINTS, MAP_SUMMARY, f"{FIGS}/paper_map.png"]
    if TRAIN:
        targets += [VIEWS["calibrate"], CALIBRATION, MANIFEST, OUT.tracking_check]
        targets += [OUT.view("train", level) for level in LEVELS]
        targets += [OUT.plan(p, s, level) for level in LEVELS for p in POLICIES for s in SEEDS]
    return list(dict.fromkeys(targets))
