"""The package as installed, not as checked out: the wheel's metadata and package data, the
CLI in a fresh venv that has only the core, and the pipeline's commands in a fresh venv that
has every extra, run from a folder outside the checkout.

The fresh venvs are built offline: the wheel is installed with `--no-deps`. The core venv sees
the core's dependencies (the closure of the wheel's unconditional Requires-Dist, resolved
through the installed distributions of this environment), linked into one folder it reads
through a .pth file; nothing of the extras (snakemake, mlflow, seaborn, av, ...) is importable
there, which the test checks before it plans a manifest with empty fps cells. The full venv sees
this environment's site-packages through a .pth file (what `venv --system-site-packages` does
for a system Python), but not the checkout: a .pth line only adds a folder to sys.path, so the
editable install's hook in that folder stays inactive.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pandas as pd
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from repo_paths import CALIBRATIONS, H200_PRIOR, ROOT, TINY

from adaptiveload.experiment import load as load_config
from adaptiveload.extras import EXTRA_OF
from adaptiveload.ops import kernel_build as kb
from adaptiveload.ops import kernel_sources as ks
from adaptiveload.ops.kernel_sources import KERNELS_DIR

EXTRAS = {"pipeline", "tracking", "kernel", "media", "diffusers", "all", "dev"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the sources (the build writes build/ and egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("adaptiveload", KERNELS_DIR):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(src), "-w", str(out)],
        check=True, capture_output=True, text=True,
    )
    (whl,) = out.glob("adaptiveload-*.whl")
    return whl


def _metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(zf.read(name))


def test_wheel_metadata_core_vs_extras(wheel):
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert set(meta.get_all("Provides-Extra")) >= EXTRAS
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    core = {canonicalize_name(r.name) for r in reqs if r.marker is None}
    assert {"torch", "numpy", "pandas"} <= core
    heavy = {"snakemake", "mlflow", "seaborn", "av", "ninja", "psutil", "pillow", "tabulate"}
    assert not core & heavy, core & heavy
    # every optional import the code guards is brought by the extra its error message names
    for module, extra in EXTRA_OF.items():
        dist = {"PIL": "pillow", "matplotlib": "seaborn"}.get(module, module)
        closure = _extra_closure(reqs, extra)
        assert dist in closure, f"{module}: not in extra {extra!r}"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    # experiment files validate when installed
    assert "adaptiveload/experiment.schema.yaml" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    shipped = {f"adaptiveload/calibration/shipped/{p.name}"
               for p in CALIBRATIONS.glob("*.json")}
    assert shipped and shipped <= set(names)  # `--calibration h200-...` works when installed


def test_wheel_carries_the_kernel_sources(wheel):
    """The wheel holds kernels/ of the checkout, byte for byte, inside the package (where an
    installed package's kernel_sources looks), and no other copy of the sources."""
    assert ks.SOURCE_DIR == ROOT / KERNELS_DIR  # this checkout's own folder
    shipped = [*ks.source_files(), ks.SOURCE_DIR / "README.md"]
    assert {p.suffix for p in shipped} == {".h", ".cuh", ".cu", ".cpp", ".md"}
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        packaged = sorted(n for n in names if n.startswith(f"adaptiveload/{KERNELS_DIR}/"))
        assert packaged == sorted(f"adaptiveload/{KERNELS_DIR}/{p.name}" for p in shipped)
        for p in shipped:
            assert zf.read(f"adaptiveload/{KERNELS_DIR}/{p.name}") == p.read_bytes(), p.name
    sources = sorted(n for n in names if n.endswith(ks.SOURCE_SUFFIXES))
    assert sources == [n for n in packaged if not n.endswith(".md")]  # no second copy


def _extra_closure(reqs: list[Requirement], extra: str) -> set[str]:
    """Distribution names an extra brings, following self-references like adaptiveload[x]."""
    names, todo, seen = set(), [extra], set()
    while todo:
        ex = todo.pop()
        seen.add(ex)
        for r in reqs:
            if r.marker is None or not r.marker.evaluate({"extra": ex}):
                continue
            if canonicalize_name(r.name) == "adaptiveload":
                todo += [e for e in r.extras if e not in seen]
            else:
                names.add(canonicalize_name(r.name))
    return names


def _core_closure(reqs: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions the core needs, transitively (markers evaluated, no extras)."""
    found: dict[str, metadata.Distribution] = {}
    todo = [r for r in reqs if r.marker is None]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        dist = metadata.distribution(name)
        found[name] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return list(found.values())


@pytest.fixture(scope="module")
def core_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv: the wheel (no deps) plus links to only the core's dependencies."""
    root = tmp_path_factory.mktemp("core")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip())
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True,
    )
    deps = root / "core-deps"
    deps.mkdir()
    reqs = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist")]
    for dist in _core_closure(reqs):
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if top != ".." and not (deps / top).exists() and (base / top).exists():
                (deps / top).symlink_to(base / top)
    (site / "core-deps.pth").write_text(f"{deps}\n")
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(python), "-m", "adaptiveload", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )


def test_core_venv_plans_a_manifest_with_empty_fps(core_python, tmp_path):
    probe = subprocess.run(
        [str(core_python), "-c",
         "import importlib.util as u, adaptiveload, sys\n"
         "print(adaptiveload.__file__)\n"
         "print(*[m for m in ('snakemake','mlflow','seaborn','av','tabulate') if u.find_spec(m)])"],
        capture_output=True, text=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
    )
    assert probe.returncode == 0, probe.stderr
    where, present = probe.stdout.splitlines()
    assert str(ROOT) not in where  # the installed wheel, not this checkout
    assert present == "", f"extras leaked into the core venv: {present}"

    manifest = tmp_path / "mine.csv"
    rows = ["sample_id,path,num_frames,height,width,fps"]
    for i in range(60):  # videos with fps, then images with an empty fps cell, interleaved
        rows.append(f"v{i},v{i}.mp4,{4 * (i % 20) + 1},480,832,16" if i % 3 else
                    f"i{i},i{i}.jpg,1,720,1280,")
    manifest.write_text("\n".join(rows) + "\n")
    described = _run(core_python, "manifest", "describe", str(manifest), "--json", cwd=tmp_path)
    assert described.returncode == 0, described.stderr
    assert '"num_samples": 60' in described.stdout
    plan = _run(
        core_python, "plan", "--manifest", str(manifest), "--policy", "adaptiveload",
        "--world-size", "4", "--seed", "0", "--m-mem", "100000", "--m-comp", "3e7",
        "--p", "1.5", "-o", "plan.parquet", "--summary", "plan.json", cwd=tmp_path,
    )
    assert plan.returncode == 0, plan.stderr
    assert "adaptiveload:" in plan.stdout and (tmp_path / "plan.parquet").stat().st_size > 0

    # the shipped calibrations are package data: by name, without a checkout
    compared = _run(
        core_python, "compare", "--manifest", str(manifest), "--world-size", "4",
        "--calibration", "h200-wan2.1-t2v-1.3b", "-o", "compare.json", cwd=tmp_path,
    )
    assert compared.returncode == 0, compared.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["calibration"]["label"] == "model (NVIDIA H200 (analytic prior))"

    # a command of an extra stops with one line naming the extra, not a traceback
    tracking = _run(core_python, "tracking", "init", cwd=tmp_path)
    assert tracking.returncode == 2
    assert tracking.stderr.strip().count("\n") == 0 and "Traceback" not in tracking.stderr
    assert "adaptiveload[tracking]" in tracking.stderr


# --- the pipeline's commands from an installed package, outside the checkout ---------------


def _purelib(python: Path) -> Path:
    return Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip())


@pytest.fixture(scope="module")
def full_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv: the wheel installed by pip (so `adaptiveload` is in its bin/, as the
    pipeline's rules call it), every extra seen through this environment's site-packages."""
    venv = tmp_path_factory.mktemp("full") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, text=True,
    )
    (_purelib(python) / "shared-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _venv_env(venv: Path, **extra: str) -> dict[str, str]:
    """This environment minus what points at the checkout or a tracking server, with the
    venv's bin/ first on PATH."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "MLFLOW_TRACKING_URI", "ADAPTIVELOAD_BUILD_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1",
               MLFLOW_ENABLE_TELEMETRY="false", DO_NOT_TRACK="1", MPLBACKEND="Agg",
               **extra)
    return env


def _cli(env: dict[str, str], cwd: Path, *args: str) -> str:
    """One `adaptiveload` command as a rule's shell line runs it; its log (stdout + stderr)."""
    return _stage(env, cwd, list(args))[0]


def _stage(env: dict[str, str], cwd: Path, *commands: list[str]) -> list[str]:
    """Independent `adaptiveload` commands (found on PATH) side by side, as Snakemake runs the
    jobs that are ready, each into its own log under cwd/logs/; each must exit 0."""
    folder = cwd / "logs"
    folder.mkdir(exist_ok=True)
    first = len(list(folder.iterdir()))  # numbered in the order the commands ran
    logs = [folder / f"{first + i}.log" for i in range(len(commands))]
    procs = []
    for command, log in zip(commands, logs, strict=True):
        with log.open("w") as f:
            procs.append(subprocess.Popen(["adaptiveload", *command], cwd=cwd, env=env,
                                          stdout=f, stderr=subprocess.STDOUT))
    for command, proc, log in zip(commands, procs, logs, strict=True):
        assert proc.wait(timeout=300) == 0, (command, log.read_text()[-3000:])
    return [log.read_text() for log in logs]


def _assert_imports_the_installed_package(venv: Path, cwd: Path, env: dict[str, str]) -> None:
    code = "import adaptiveload; print(adaptiveload.__file__)"
    probe = subprocess.run(["python", "-c", code], cwd=cwd, env=env, capture_output=True,
                           text=True, check=True)
    where = Path(probe.stdout.strip())
    assert where.is_relative_to(_purelib(venv / "bin" / "python")), where  # not the checkout


def test_installed_package_runs_the_pipelines_commands(full_venv, tmp_path):
    """The tiny experiment's stages, each the command its rule in workflow/rules/ runs, from a
    folder outside the checkout: manifests, describe, tracking store, calibration, plans,
    training, a simulation, and the analysis (aggregate, statistics, tables, figures, the
    MLflow analysis run). Smaller than the pipeline's tiny run: one seed, 3 steps (2 timed),
    3 calibration sizes, a 60-sample simulation, 3 figures."""
    work = tmp_path / "work"
    work.mkdir()
    env = _venv_env(full_venv, XDG_CACHE_HOME=str(tmp_path / "cache"))
    _assert_imports_the_installed_package(full_venv, work, env)
    assert shutil.which("adaptiveload", path=env["PATH"]) == str(full_venv / "bin/adaptiveload")

    sim_cal = "h200.json"  # a simulation's calibration file, as a user brings one
    shutil.copy(H200_PRIOR, work / sim_cal)
    cfg = yaml.safe_load(TINY.read_text())
    cfg["seeds"] = [0]
    cfg["train"]["steps"] = 3
    cfg["calibration"].update(tokens=[16, 256, 2048], warmup=0)
    cfg["simulate"] = [dict(cfg["simulate"][0], calibration=sim_cal, num_samples=60)]
    cfg["sweeps"] = {"p": []}
    (work / "tiny.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cfg = load_config(work / "tiny.yaml")  # with the defaults the commands fill in
    data, sim, policies = cfg["data"], cfg["simulate"][0], cfg["policies"]
    frames = ["--max-frames", str(data["max_frames"])]
    bucket = ["--bucketing", data["bucketing"], "--grid", data["grid"], *frames]
    sim_bucket = ["--bucketing", sim["bucketing"], "--grid", sim["grid"], *frames]
    cal, manifest, sim_manifest = "calibration.json", "data/manifest.parquet", "sim/mixture.parquet"
    run = {p: f"runs/{p}/seed0/eager" for p in policies}
    simd = {p: f"sim/{p}/seed0" for p in policies}

    _stage(env, work,
           ["manifest", "synth", "--mixture", data["mixture"], "-n", str(data["num_samples"]),
            "--seed", "0", "-o", manifest],
           ["manifest", "synth", "--mixture", sim["mixture"], "-n", str(sim["num_samples"]),
            "--seed", "0", "-o", sim_manifest],
           ["tracking", "init"])
    _stage(env, work,
           ["manifest", "describe", manifest, *bucket, "--json", "-o", "describe.json"],
           ["calibrate", "measure", "--config", "tiny.yaml", "--threads", "1", "--manifest",
            manifest,
            "-o", cal],
           *[["plan", "--manifest", sim_manifest, "--policy", p, "--seed", "0",
              "--calibration", sim_cal, "--world-size", str(sim["world_size"]), *sim_bucket,
              "--allreduce-gbps", str(sim["allreduce_gbps"]),
              "--simulation-steps", f"{simd[p]}/steps.parquet",
              "--simulation-summary", f"{simd[p]}/summary.json", "--experiment", cfg["name"]]
             for p in policies])
    _stage(env, work,
           *[["plan", "--manifest", manifest, "--policy", p, "--seed", "0", "--calibration",
              cal, "--world-size", str(cfg["train"]["world_size"]), *bucket, "--allreduce-gbps",
              str(cfg["train"]["allreduce_gbps"]), "--summary", f"plans/{p}.json"]
             for p in policies])
    _stage(env, work,
           *[["train", "--config", "tiny.yaml", "--policy", p, "--seed", "0", "--kernel",
              "eager", "--emulate-world-size", str(cfg["train"]["world_size"]),
              "--calibration", cal, "--manifest", manifest, "--out", run[p]]
             for p in policies])

    index = [dict(setup="train", variant="base", summary=f"{run[p]}/summary.json",
                  steps=f"{run[p]}/steps.parquet", calibration=cal) for p in policies]
    index += [dict(setup=f"sim/{sim['name']}", variant="base", experiment=cfg["name"],
                   kernel="none", summary=f"{simd[p]}/summary.json",
                   steps=f"{simd[p]}/steps.parquet", calibration=sim_cal) for p in policies]
    (work / "run_index.json").write_text(json.dumps(index))
    _cli(env, work, "analyze", "aggregate", "--index", "run_index.json",
         "--runs-out", "runs.parquet", "--steps-out", "steps.parquet")
    tables = ["--runs", "runs.parquet", "--steps", "steps.parquet"]
    baseline = ["--baseline", cfg["analysis"]["baseline"]]
    _cli(env, work, "analyze", "stats", "--runs", "runs.parquet", "--csv", "stats.csv",
         "--md", "stats.md", *baseline, "--seed", "0")
    tables += ["--stats", "stats.csv"]
    figures = ["throughput", "calibration_fit", "imbalance_distribution"]
    _stage(env, work,
           ["analyze", "tables", *tables, "--out-dir", "tables", *baseline],
           ["analyze", "figures", *tables, "--describe", "describe.json", "--calibration", cal,
            "--mixture", data["mixture"], "--out-dir", "figures",
            *[a for f in figures for a in ("--figure", f)]])
    _cli(env, work, "analyze", "record", "--experiment", cfg["name"], "--paper-table",
         "tables/paper_table.csv", "--stats", "stats.csv", "--config", "tiny.yaml",
         "-o", "analysis.json")

    assert len(pd.read_parquet(work / manifest)) == data["num_samples"]
    assert json.loads((work / "describe.json").read_text())["num_samples"] == data["num_samples"]
    calibration = json.loads((work / cal).read_text())
    assert all(calibration[k] > 0 for k in ("p", "m_mem", "m_comp")), calibration
    runs = pd.read_parquet(work / "runs.parquet")
    assert len(runs) == 4 and set(runs["policy"]) == set(policies)
    steps = pd.read_parquet(work / "steps.parquet")
    trained = steps[steps["setup"] == "train"]
    assert set(trained["step"]) == {0, 1, 2} and set(trained["rank"]) == {0, 1}
    assert (trained["tokens"] > 0).all()
    stats = pd.read_csv(work / "stats.csv")
    assert set(stats["setup"]) == {"train", f"sim/{sim['name']}"}
    assert set(stats["policy"]) == {"adaptiveload"} and set(stats["baseline"]) == {"equal-token"}
    assert all(p in (work / "tables/paper_table.md").read_text() for p in policies)
    for name in figures:
        assert (work / "figures" / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    assert json.loads((work / "analysis.json").read_text())
    assert (work / "results" / "mlflow.db").stat().st_size > 0  # the store in the working dir
    assert not (tmp_path / "cache" / "adaptiveload").exists()  # no kernel build ran


def test_installed_package_builds_and_loads_the_kernel_from_the_user_cache(full_venv, tmp_path):
    """`adaptiveload kernel build` of an installed package compiles the sources it ships into
    the user cache folder ($XDG_CACHE_HOME/adaptiveload/kernels), where the loader then finds
    the library with no variable set (~40 s: one nvcc build for sm_90)."""
    if reason := kb.skip_reason():
        pytest.skip(f"cannot build the CUDA library here: {reason}")
    cache = tmp_path / "cache"
    env = _venv_env(full_venv, XDG_CACHE_HOME=str(cache), TORCH_CUDA_ARCH_LIST="9.0")
    _assert_imports_the_installed_package(full_venv, tmp_path, env)
    log = _cli(env, tmp_path, "kernel", "build")
    build_dir = cache / "adaptiveload" / "kernels"
    record = json.loads((build_dir / kb.RECORD_NAME).read_text())
    assert record["status"] == "built" and "kernel build built" in log, record
    assert record["sources_digest"] == ks.sources_digest()  # the wheel's copy of kernels/
    code = "from adaptiveload.ops import ln_modulate as lm\nprint(lm._LOAD.loaded, lm._LOAD.path)"
    probe = subprocess.run(["python", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                           text=True, check=True)
    assert probe.stdout.split() == ["True", str(build_dir / "adaptiveload_kernels.so")]
