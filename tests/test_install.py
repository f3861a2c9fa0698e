"""The light core: the wheel's metadata, and the CLI in a fresh venv that has only the core.

The fresh venv is built offline: the wheel is installed with `--no-deps`, and the core's
dependencies (the closure of the wheel's unconditional Requires-Dist, resolved through the
installed distributions of this environment) are linked into one folder the venv sees through a
.pth file. Nothing of the extras (snakemake, mlflow, seaborn, av, ...) is importable there,
which the test checks before it plans a manifest with empty fps cells.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from adaptiveload.extras import EXTRA_OF

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"pipeline", "tracking", "kernel", "media", "all", "dev"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the sources (the build writes build/ and egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "adaptiveload", src / "adaptiveload",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(src), "-w", str(out)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
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
    assert "adaptiveload/config.schema.yaml" in names  # experiment files validate when installed
    assert any(n.endswith("licenses/LICENSE") for n in names)


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
    ).strip())  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
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
    )  # fmt: skip


def test_core_venv_plans_a_manifest_with_empty_fps(core_python, tmp_path):
    probe = subprocess.run(
        [str(core_python), "-c",
         "import importlib.util as u, adaptiveload, sys\n"
         "print(adaptiveload.__file__)\n"
         "print(*[m for m in ('snakemake','mlflow','seaborn','av','tabulate') if u.find_spec(m)])"],
        capture_output=True, text=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    where, present = probe.stdout.splitlines()
    assert str(ROOT) not in where  # the installed wheel, not this checkout
    assert present == "", f"extras leaked into the core venv: {present}"

    manifest = tmp_path / "mine.csv"
    rows = ["sample_id,path,num_frames,height,width,fps"]
    for i in range(60):  # videos with fps, then images with an empty fps cell, interleaved
        rows.append(f"v{i},v{i}.mp4,{4 * (i % 20) + 1},480,832,16" if i % 3 else
                    f"i{i},i{i}.jpg,1,720,1280,")  # fmt: skip
    manifest.write_text("\n".join(rows) + "\n")
    described = _run(core_python, "manifest", "describe", str(manifest), "--json", cwd=tmp_path)
    assert described.returncode == 0, described.stderr
    assert '"num_samples": 60' in described.stdout
    plan = _run(
        core_python, "plan", "--manifest", str(manifest), "--policy", "adaptiveload",
        "--world-size", "4", "--seed", "0", "--m-mem", "100000", "--m-comp", "3e7",
        "--p", "1.5", "-o", "plan.parquet", "--summary", "plan.json", cwd=tmp_path,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert "adaptiveload:" in plan.stdout and (tmp_path / "plan.parquet").stat().st_size > 0

    # a command of an extra stops with one line naming the extra, not a traceback
    tracking = _run(core_python, "tracking", "init", cwd=tmp_path)
    assert tracking.returncode == 2
    assert tracking.stderr.strip().count("\n") == 0 and "Traceback" not in tracking.stderr
    assert "adaptiveload[tracking]" in tracking.stderr
