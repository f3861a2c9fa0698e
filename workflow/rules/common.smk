# Shared helpers for the rules: paths and target lists derived from the validated config.
# Layout (one experiment never overwrites another; see README "Where results land"):
#   results/<name>/...            everything per experiment (data, plans, runs, sims, analysis)
#   results/tables, results/figures   the published tables/figures of the `default` experiment
#   results/<name>/tables|figures     ... of any other experiment
#   logs/<name>/, benchmarks/<name>/  one log and one benchmark file per job
#   results/mlflow.db             the MLflow store shared by all experiments
import json
import os
import sys

import yaml

EXP = config["name"]
RES = f"results/{EXP}"
PUB = "results" if EXP == "default" else RES
TABLES = f"{PUB}/tables"
FIGS = f"{PUB}/figures"
LOGS = f"logs/{EXP}"
BENCH = f"benchmarks/{EXP}"
envvars:
    "PATH",


# jobs find `adaptiveload` beside the Python running Snakemake (.venv/bin): no activation needed
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# the same software as a conda environment, for `--software-deployment-method conda` (untested)
CONDA_ENV = "../envs/adaptiveload.yaml"

SEEDS = config["seeds"]
POLICIES = config["policies"]
KERNELS = config["model"]["kernels"]
TRAIN = config["train"]["enabled"]
SIMS = {s["name"]: s for s in config["simulate"]}
SWEEPS = config["sweeps"]

# timing jobs (calibrate, train) take the whole machine; Snakemake caps this at --cores
ALL_CORES = os.cpu_count() or 1


def calibration_threads():
    """The experiment's calibration threads, else one on a CPU (where the timer counts that
    thread's CPU seconds) and the whole machine on a GPU or with the wall-clock timer."""
    cal = config["calibration"]
    if cal["threads"]:
        return cal["threads"]
    return 1 if cal["device"] == "cpu" and cal["timer"] != "wall" else ALL_CORES


STORE = f"{RES}/tracking/store.ready"
CONFIG = f"{RES}/config.yaml"
CALIBRATION = f"{RES}/calibration/calibration.json"
MANIFEST = config["data"]["manifest"] or f"{RES}/data/manifest.parquet"
DESCRIBE = f"{RES}/data/describe.json"
KERNEL_BUILD = "build/kernels/build.json"
KERNEL_BENCH = [f"{RES}/kernel/bench.csv"] if config["kernel"]["bench"] else []
PAPER_MAP = config["paper_map"]["enabled"]
MAP_POINTS = f"{RES}/paper_map/points.csv"
MAP_SUMMARY = f"{RES}/paper_map/summary.json"


wildcard_constraints:
    policy="|".join(POLICIES),
    seed=r"\d+",
    kernel="eager|fused",
    sim="|".join(SIMS) if SIMS else "NO_SIMULATION",
    variant=r"base|p=[0-9.]+|m_comp=[0-9.e+-]+|world_size=\d+|mixture=[A-Za-z0-9_.-]+",
    mixture=r"[A-Za-z0-9_.-]+",


def bucket_flags(section):
    """--bucketing/--grid/--max-frames of a config section (data or a simulate entry)."""
    flags = f"--bucketing {section['bucketing']} --grid {section['grid']}"
    return flags + f" --max-frames {section.get('max_frames', config['data']['max_frames'])}"


def budget_flags():
    """Numeric budgets of the config override the calibration's ('auto' = take the
    calibration's; a null pack_tokens = none)."""
    return " ".join(
        f"--{name.replace('_', '-')} {value}"
        for name, value in config["budgets"].items()
        if value not in ("auto", None)
    )


# ---------------------------------------------------------------- simulations and sweeps
def variants():
    """'base' plus one variant per sweep point; each is planned and simulated for every policy."""
    out = ["base"]
    out += [f"p={v}" for v in SWEEPS["p"]]
    out += [f"m_comp={v}" for v in SWEEPS["m_comp_scale"]]
    out += [f"world_size={v}" for v in SWEEPS["world_sizes"]]
    out += [f"mixture={v}" for v in SWEEPS["mixtures"]]
    return out


def sim_mixture(wildcards):
    axis, _, value = wildcards.variant.partition("=")
    return value if axis == "mixture" else SIMS[wildcards.sim]["mixture"]


def sim_manifest(wildcards):
    return f"{RES}/sim/{wildcards.sim}/manifests/{sim_mixture(wildcards)}.parquet"


def sim_flags(wildcards):
    """The plan flags of one sweep point of one simulate entry. `adaptiveload plan` resolves
    the budgets of a p or M_comp point from the calibration (`Calibration.m_comp_at`)."""
    sim = SIMS[wildcards.sim]
    axis, _, value = wildcards.variant.partition("=")
    world = int(value) if axis == "world_size" else sim["world_size"]
    flags = f"--world-size {world} {bucket_flags(sim)} --allreduce-gbps {sim['allreduce_gbps']}"
    if axis == "p":
        flags += f" --p {value}"
    elif axis == "m_comp":
        flags += f" --m-comp-scale {value}"
    return flags


def sim_dir(sim, variant, policy, seed):
    return f"{RES}/sim/{sim}/{variant}/{policy}/seed{seed}"


# ---------------------------------------------------------------- the paper map
def map_calibrations():
    """Every calibration file the map's centre, axes and factorial name (inputs of the sweep)."""
    spec = config["paper_map"]
    files = {spec["centre"]["calibration"]}
    for section in (spec["axes"], spec["factorial"]):
        files.update(section.get("calibration") or [])
    return sorted(files)


# ---------------------------------------------------------------- the run index
def run_index():
    """Every run the analysis reads: training runs (measured) and simulations (model)."""
    runs = []
    if TRAIN:
        for policy in POLICIES:
            for seed in SEEDS:
                for kernel in KERNELS:
                    d = f"{RES}/runs/{policy}/seed{seed}/{kernel}"
                    runs.append(dict(setup="train", variant="base", summary=f"{d}/summary.json",
                                     steps=f"{d}/steps.parquet", calibration=CALIBRATION))
    for sim in SIMS:
        for variant in variants():
            for policy in POLICIES:
                for seed in SEEDS:
                    d = sim_dir(sim, variant, policy, seed)
                    runs.append(dict(setup=f"sim/{sim}", variant=variant, experiment=EXP,
                                     kernel="none", summary=f"{d}/summary.json",
                                     steps=f"{d}/steps.parquet",
                                     calibration=SIMS[sim]["calibration"]))
    return runs


def run_files():
    return [f for r in run_index() for f in (r["summary"], r["steps"])]


# ---------------------------------------------------------------- figures and tables
def figure_names():
    names = ["mixture_tokens", "compute_heatmap", "imbalance_distribution", "throughput",
             "vram_utilization", "calibration_fit", "kernel_bandwidth"]
    for axis, name in (("p", "p_sweep"), ("m_comp_scale", "m_comp_sweep"),
                       ("world_sizes", "world_size_scaling"), ("mixtures", "mixture_sweep")):
        if SWEEPS[axis]:
            names.append(name)
    return names


def describe_input():
    """The manifest the mixture figure describes: training's, else the first simulation's."""
    if TRAIN:
        return MANIFEST
    sim = next(iter(SIMS.values()))
    return f"{RES}/sim/{sim['name']}/manifests/{sim['mixture']}.parquet"


def describe_flags():
    return bucket_flags(config["data"] if TRAIN else next(iter(SIMS.values())))


TABLE_FILES = [f"{TABLES}/{t}.{ext}" for t in ("paper_table", "kernel_table")
               for ext in ("csv", "md", "html")]


def all_targets():
    targets = [CONFIG, f"{TABLES}/stats.md", f"{RES}/analysis/mlflow_analysis.json",
               *TABLE_FILES, *[f"{FIGS}/{name}.png" for name in figure_names()]]
    if config["kernel"]["build"]:
        targets.append(KERNEL_BUILD)
    if PAPER_MAP:
        targets += [MAP_SUMMARY, f"{FIGS}/paper_map.png"]
    if TRAIN:
        targets += expand(f"{RES}/plans/{{policy}}/seed{{seed}}.json", policy=POLICIES,
                          seed=SEEDS)
    return targets
