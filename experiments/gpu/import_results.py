"""Bring the outputs of one `experiments/gpu/h200.sh` run into the repository, checked.

    python experiments/gpu/import_results.py PACKDIR     # the folder of the run's tarballs
    python experiments/gpu/import_results.py OUTDIR --dest results/reference/h200/{date}

SOURCE is what h200.sh packed (a folder of `<part>.tar.gz`, or one tarball) or its OUTDIR.
DEST (default results/reference/h200/<date of the run>; `-2`, `-3`, ... when that exists)
receives the run. Validates before writing anything: a GPU run on an H200 (device string
from env.json), a `source: measured` calibration of the 1.3B whose fit has R^2 and
measured memory, and run summaries that are `measured`, emulated over 16 ranks, with their
per-step tables. Then replaces DEST with the run's files (logs over 256 KB are left out) plus:
  provenance.json  date, device, driver, versions, repo commit, parts and their status,
                   the calibration's additivity (its mixed packs against the fit), the
                   archive's sha256, when it was imported;
  run_index.json   the training runs in the analysis run-index format, so that
                   `adaptiveload analyze aggregate --index DEST/run_index.json` (or the
                   pipeline's run_index()) puts the measured rows beside the model rows.
The kernel part (experiments/gpu/kernel_check.sh's folder) is also copied to
results/reference/kernels/h200-<date>/, where the kernel's GPU runs are kept
(`--kernel-dest`, or `--kernel-dest ''` for none).
`--merge` lays a partial rerun (`PARTS=...`) over what DEST holds, then validates the whole.
`--allow-dry-run` accepts a DRY_RUN=1 output (CPU, micro model) for testing this script.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import summarize  # experiments/gpu, beside this script

from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.io import read_json, write_json

MAX_LOG_BYTES = 256 * 1024
MODEL = "wan2.1-t2v-1.3b"
SETUP = "h200-measured"


def _root(tree: Path) -> Path:
    """The folder holding steps.tsv (the OUTDIR of the run) inside an extracted archive."""
    found = sorted(tree.rglob("steps.tsv"), key=lambda p: len(p.parts))
    if not found:
        raise UserError(f"{tree}: no steps.tsv: not the output of experiments/gpu/h200.sh")
    return found[0].parent


def _env_txt(root: Path) -> dict[str, str]:
    out = {}
    path = root / "env.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        key, sep, value = line.partition(": ")
        if sep and key in ("date", "repo commit", "dry run"):
            out[key] = value.strip()
        elif line.startswith("NVIDIA") or "H200" in line:
            out.setdefault("nvidia_smi", line.strip())
    return out


def validate(root: Path, dry: bool) -> dict[str, Any]:
    """Everything the import relies on; returns what provenance.json needs."""
    env = read_json(root / "env.json")
    device = str(env.get("device"))
    if not dry and "H200" not in device:
        raise UserError(f"{root / 'env.json'}: device {device!r} is not an H200")
    with (root / "steps.tsv").open() as fh:
        parts = {r["part"]: r for r in csv.DictReader(fh, delimiter="\t")}
    cal_files = sorted((root / "calibration").glob("*.json"))
    if len(cal_files) != 1:
        raise UserError(
            f"{root / 'calibration'}: expected one calibration JSON, found {len(cal_files)} "
            "(did the calibrate part finish? see steps.tsv)"
        )
    cal = Calibration.load(cal_files[0])
    if cal.source != "measured":
        raise UserError(f"{cal_files[0]}: source {cal.source!r}, expected 'measured'")
    fit = cal.extra.get("fit", {})
    if fit.get("r2") is None:
        raise UserError(f"{cal_files[0]}: no fit R^2")
    if not dry and (cal.model != MODEL or cal.extra.get("memory_source") != "measured"):
        raise UserError(f"{cal_files[0]}: expected {MODEL} with measured memory")
    runs = []
    for summary_path in sorted((root / "train").glob("*/summary.json")):
        s = read_json(summary_path)
        bad = {k: s.get(k) for k, want in (("source", "measured"), ("launch_mode", "emulated"),
                                           ("world_size", 16)) if s.get(k) != want}
        if bad:
            raise UserError(f"{summary_path}: unexpected {bad}")
        if not (summary_path.parent / "steps.parquet").is_file():
            raise UserError(f"{summary_path.parent}: steps.parquet missing")
        runs.append(summary_path.parent.name)
    if not runs:
        raise UserError(f"{root / 'train'}: no training run finished (see steps.tsv)")
    return {
        "device": device,
        "env": env,
        "parts": {k: {"status": v["status"], "seconds": v["seconds"]} for k, v in parts.items()},
        "calibration": cal_files[0].relative_to(root).as_posix(),
        "calibration_label": cal.label,
        "additivity": summarize.additivity_summary(cal.extra),
        "runs": runs,
    }


def _copy_tree(root: Path, dest: Path) -> list[str]:
    skipped = []
    for src in sorted(root.rglob("*")):
        if src.is_dir():
            continue
        rel = src.relative_to(root)
        if src.suffix == ".log" and src.stat().st_size > MAX_LOG_BYTES:
            skipped.append(f"{rel.as_posix()} ({src.stat().st_size} bytes)")
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return skipped


def import_run(
    source: Path,
    dest: Path,
    dry: bool = False,
    kernel_dest: str | None = None,
    merge: bool = False,
) -> dict[str, Any]:
    """Validate `source` (archive or folder), then replace `dest` with it + provenance;
    `kernel_dest` (may hold '{date}') also receives the kernel folder. `merge` lays the run
    over what `dest` holds (a partial rerun, `PARTS=...`) and validates the result."""
    with tempfile.TemporaryDirectory() as tmp:
        archives = [source] if source.is_file() else sorted(source.glob("*.tar.gz"))
        if source.is_dir() and (source / "steps.tsv").is_file() and not archives:
            root, digest = _root(source), None
        elif archives:
            extracted = Path(tmp) / "extracted"
            sha = hashlib.sha256()
            for archive in archives:  # the parts' tarballs share one top folder
                with tarfile.open(archive) as tar:
                    tar.extractall(extracted, filter="data")
                sha.update(archive.read_bytes())
            root, digest = _root(extracted), sha.hexdigest()
        else:
            raise UserError(f"{source}: no such archive, folder of archives, or run folder")
        tree, previous = Path(tmp) / "tree", None
        if merge:
            dest = _dated(dest, (_env_txt(root).get("date") or "unknown")[:10], merge)
        if merge and dest.is_dir():
            skip = shutil.ignore_patterns("provenance.json", "run_index.json")
            shutil.copytree(dest, tree, ignore=skip)
            if (dest / "provenance.json").is_file():
                previous = read_json(dest / "provenance.json")
        skipped = _copy_tree(root, tree)
        if previous is not None or merge:
            summarize.main(tree)  # the summary of the merged whole, not of the rerun alone
        try:
            info = validate(tree, dry)
        except UserError as exc:  # name the archive, not the scratch folder it was opened in
            raise UserError(str(exc).replace(str(tree), f"{source} (as imported)")) from None
        env_txt = _env_txt(tree)
        dest = _dated(dest, (env_txt.get("date") or "unknown")[:10], merge)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".h200-import-", dir=dest.parent))
        shutil.copytree(tree, staged, dirs_exist_ok=True)
    provenance = {
        "what": "measured GPU evidence: 2-process check, kernel, calibration, short training",
        "date": env_txt.get("date"),
        "device": info["device"],
        "nvidia_smi": env_txt.get("nvidia_smi"),
        "versions": info["env"].get("versions"),
        "torch_cuda": info["env"].get("torch_cuda"),
        "repo_commit": env_txt.get("repo commit"),
        "dry_run": env_txt.get("dry run") == "1",
        "parts": info["parts"],
        "calibration": info["calibration"],
        "calibration_label": info["calibration_label"],
        "additivity": info["additivity"],
        "training_runs": info["runs"],
        "dist_check": summarize.dist_summary(staged),
        "dest": dest.as_posix(),
        "archive_sha256": digest,
        "imported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "logs_left_out": skipped,
        "merged_over": previous,
    }
    write_json(staged / "provenance.json", provenance)
    index = [
        {"setup": SETUP, "variant": "base", "summary": (dest / "train" / run / "summary.json")
         .as_posix(), "steps": (dest / "train" / run / "steps.parquet").as_posix(),
         "calibration": (dest / "train" / "calibration-train.json").as_posix()}
        for run in info["runs"]
    ]
    write_json(staged / "run_index.json", index)
    _replace(staged, dest)
    if kernel_dest and (dest / "kernel").is_dir():
        date = (provenance["date"] or "unknown")[:10]
        target = Path(kernel_dest.format(date=date))
        target.parent.mkdir(parents=True, exist_ok=True)
        staged_kernel = Path(tempfile.mkdtemp(prefix=".h200-kernel-", dir=target.parent))
        shutil.copytree(dest / "kernel", staged_kernel, dirs_exist_ok=True)
        _replace(staged_kernel, target)
        provenance["kernel_copy"] = target.as_posix()
        write_json(dest / "provenance.json", provenance)
    return provenance


def _dated(dest: Path, date: str, merge: bool) -> Path:
    """`dest` with its `{date}` filled; a new import never replaces an earlier one of the same
    date (`-2`, `-3`, ... instead), a merge goes into the folder it names."""
    path = Path(str(dest).format(date=date))
    if merge or not path.exists() or "{date}" not in str(dest):
        return path
    n = 2
    while path.with_name(f"{path.name}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}-{n}")


def _replace(staged: Path, dest: Path) -> None:
    """Move the finished `staged` folder to `dest`, replacing what was there."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
        staged.rename(dest)
        shutil.rmtree(old)
    else:
        staged.rename(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="PACKDIR, one of its tarballs, or OUTDIR")
    parser.add_argument("--dest", type=Path, default=Path("results/reference/h200/{date}"))
    parser.add_argument(
        "--kernel-dest", default="results/reference/kernels/h200-{date}",
        help="also copy the kernel folder here ('' for no copy)",
    )
    parser.add_argument("--merge", action="store_true", help="lay a partial rerun over DEST")
    parser.add_argument("--allow-dry-run", action="store_true", help="accept a CPU dry run")
    args = parser.parse_args(argv)
    try:
        prov = import_run(
            args.source, args.dest, args.allow_dry_run, args.kernel_dest or None, args.merge
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    add = prov["additivity"]
    packs = (
        f" (additivity of {add['num_measured']} packs: median {100 * add['median_rel_err']:.1f}% "
        f"worst {100 * add['max_rel_err']:.1f}%)"
        if add and add["num_measured"]
        else ""
    )
    print(
        f"{prov['dest']}: {prov['device']} ({prov['date']}), calibration {prov['calibration']}"
        f"{packs}, {len(prov['training_runs'])} training run(s); parts "
        + ", ".join(f"{k}={v['status']}" for k, v in prov["parts"].items()),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
