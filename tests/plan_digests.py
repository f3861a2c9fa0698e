"""Replan every plan the pipeline would make for the experiment files and list their digests.

    python tests/plan_digests.py -o digests.json                   # all experiments/*.yaml
    python tests/plan_digests.py --compare tests/fixtures/plan_digests.json  # all of them again

tests/fixtures/plan_digests.json holds the digests of the 489 plans of every experiment file at
commit b54dae1: the 360 plans of commit 48e969a (before the refactor that gave each module its
layer), identical there, under the digest that names samples by id (`data_digest` inside
`plan_digest`; those 360 were checked unchanged by the former digest before the file was
rewritten), and the 129 plans of the packed policy and the N = 256 simulation added since. A
change meant to keep every plan is checked against it. The file was regenerated when the
packed policy's seeds and epochs began to vary pack compositions and the plan digest began to
cover the world size (a plan of 2 ranks and one of 4 that deal the same slots are two plans).
Then the plans of the matched-steps simulations (`-matched` entries of default, paper and
paper_1gpu), long-clips in the mixture sweep and experiments/matched.yaml were added.
Since then (717 plans): the sequence-parallel plans (experiments/sp.yaml and paper_14b's SP
entry) and both step modes of experiments/convergence.yaml were added; the other 627 plans were
identical before and after the sequence-parallel planner, and the 12 convergence plans changed
on purpose (144 samples instead of 160). Then (905 plans) the field's methods as baselines were
added: their plans in default.yaml's four measured 1.3B simulations (and in matched's and
paper_1gpu's, which take those entries, with the policies the entries now name, packed among
them) and experiments/baselines.yaml's training plans; the other 717 were identical. Then (964
plans, the file written again from every experiment file as it is: the seeds added to default,
matched and paper_1gpu since, baselines.yaml at 5 seeds) the plans of the packed and
sequence-parallel policies changed on purpose (caps that may be filled exactly, seeds that vary
which token counts share a pack, step levelling): of the 888 plans in both files, the 236 of
adaptiveload-packed, adaptiveload-sp and adaptiveload-sp-fixed changed and the 652 of every
other policy were identical. Then (964 plans) 13 changed on purpose, the ones where step
levelling's second way (the pinned steps filled with the costliest samples first,
`packing._fill_pinned`) levels the steps better than the first: 12 of adaptiveload-packed
(convergence's two matched seeds, m_comp_sweep at M_comp x 0.5, matched's 14B simulation,
the 14B long-clip simulations of paper_14b and sp) and 1 of adaptiveload-sp-fixed (sp's 14B
at N = 256); the other 951 were identical (the planner's speed-ups changed none). Then (964
plans) 97 changed on purpose, 80 of adaptiveload-packed and 17 of adaptiveload-sp-fixed, every
other policy's identical: LPT takes equal loads in pack order and the limits' powers and cost
bands come from libm (np.argpartition and numpy's AVX-512 pow/log had made these plans differ
between CPUs; the file's earlier digests were those of AVX-512 machines), which alone changed
the 97; and step levelling is skipped where it can gain under 0.1% of a window, which changed
44 of those 97 again and no other.

A refactor that must not change any plan is checked by running this before and after it: the
plan commands come from the pipeline itself (`snakemake -n -p -F` per experiment file, so the
rules' own flags are replanned), their manifests are synthesized by the pipeline's own
`manifest synth` commands, and each plan's `plan_digest` (`planning.plan`: a hash over the
samples of every micro-batch and its slot) is read from the summary the plan command writes.
A plan is named by where the pipeline puts it under results/ (`plan_name`: e.g.
`default/plans/adaptiveload/seed0`, `default/sim/h200-1.3b-prior/base/adaptiveload/seed0`).

A training plan's calibration is measured by the pipeline (`results/<name>/calibration/`), so
here it is replaced by a fixed stand-in of the same model: the shipped H200 prior where one
exists (`experiments/calibration/h200-<model>.json`), else `tests/fixtures/tiny-prior.json`.
Everything runs in one process, outputs in a temporary folder; nothing in the checkout is
written but Snakemake's own `.snakemake/` metadata.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAND_IN_TINY = REPO / "tests" / "fixtures" / "tiny-prior.json"
# the pipeline's commands that make a plan's inputs or the plan itself (`budgets`: a simulate
# entry's budgets at its own capacity_gb, which it prints to the file its rule redirects to)
PLANNING = (("manifest", "synth"), ("budgets",), ("plan",))


def pipeline_commands(experiment: Path) -> list[list[str]]:
    """The `adaptiveload` command lines (argument lists) of every planning job of a dry run;
    one that prints its output to a file (`> FILE 2> LOG`) ends with ">", FILE."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), "-n", "-p", "-F", "--configfile",
         str(experiment.relative_to(REPO))],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=600,
    )
    out = []
    for shell in re.findall(r"^Shell command: (.*)$", proc.stdout, re.M):
        shell = re.sub(r"\s*>\s*\S+\s*2>&1\s*$", "", shell).strip().strip("()")
        for part in shell.split("&&"):
            args = shlex.split(part.strip())
            if ">" in args:  # stdout to a file, stderr to a log: keep the file
                args = [*args[: args.index(">")], ">", args[args.index(">") + 1]]
            if args[:1] == ["adaptiveload"] and any(
                tuple(args[1 : 1 + len(cmd)]) == cmd for cmd in PLANNING
            ):
                out.append(args[1:])
    return out


def localize(args: list[str], tmp: Path, model: str) -> list[str]:
    """`args` with every results/ path moved under `tmp`, and a calibration the pipeline would
    measure replaced by the model's stand-in (the shipped H200 prior, else the tiny one)."""
    shipped = REPO / "experiments" / "calibration" / f"h200-{model}.json"
    out = []
    for i, arg in enumerate(args):
        measured = re.fullmatch(r"results/[^/]+/calibration/calibration\.json", arg)
        if i and args[i - 1] == "--calibration" and measured:
            arg = str(shipped if shipped.exists() else STAND_IN_TINY)
        elif arg.startswith("results/"):
            arg = str(tmp / arg)
        out.append(arg)
    return out


def layered(experiment: Path) -> dict:
    """The experiment resolved over the default one."""
    try:  # the experiment loader's module was renamed once; either version runs this script
        from adaptiveload.experiment import load_layered
    except ImportError:
        from adaptiveload.config import load_layered  # type: ignore[no-redef]
    return load_layered(experiment)


def user_data_present(experiment: Path) -> bool:
    """Whether the experiment's data can be planned here: a mixture it synthesizes, or a
    user's manifest (experiments/finetune.yaml names one the user makes) that exists."""
    manifest = layered(experiment)["data"].get("manifest")
    return manifest is None or (REPO / manifest).exists()


def digests(experiment: Path) -> dict[str, str]:
    """plan summary path (under results/) -> plan_digest, for every plan of `experiment`."""
    from adaptiveload.cli import _register, app

    _register()
    model = layered(experiment)["model"]["config"]
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for args in pipeline_commands(experiment):
            local = localize(args, Path(tmp), model)
            if ">" in local:  # what the command prints is its output file
                target = Path(local[-1])
                target.parent.mkdir(parents=True, exist_ok=True)
                with target.open("w") as sink, contextlib.redirect_stdout(sink):
                    app(local[:-2], standalone_mode=False)
            else:
                app(local, standalone_mode=False)
            if args[0] == "plan":
                key, digest = read_digest(args, local)
                found[key] = digest
    return found


def read_digest(args: list[str], local: list[str]) -> tuple[str, str]:
    """The plan's name and digest: from its summary (--summary), else from the simulation's
    run summary, which carries the plan's summary under `plan` (--simulation-summary)."""
    for flag in ("--summary", "--simulation-summary"):
        if flag in args:
            summary = json.loads(Path(local[local.index(flag) + 1]).read_text())
            plan = summary if flag == "--summary" else summary["plan"]
            return plan_name(args[args.index(flag) + 1]), plan["plan_digest"]
    raise SystemExit(f"a plan command without a summary: {' '.join(args)}")


def plan_name(path: str) -> str:
    """A plan's name from the path of a summary it wrote: a training plan's file without its
    suffix (`default/plans/adaptiveload/seed0`), a simulation's folder
    (`default/sim/<entry>/<variant>/<policy>/seed0`)."""
    path = path.removeprefix("results/")
    return path.removesuffix(".json") if "/plans/" in path else path.rpartition("/")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*", type=Path,
                        default=sorted((REPO / "experiments").glob("*.yaml")))
    parser.add_argument("-o", "--out", type=Path, help="write the digests as JSON")
    parser.add_argument("--compare", type=Path, help="digests JSON to compare with")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    found: dict[str, str] = {}
    for experiment in args.experiments:
        if not user_data_present(experiment.resolve()):
            print(f"{experiment.name}: skipped (its data.manifest is the user's own, absent)",
                  file=sys.stderr)
            continue
        plans = digests(experiment.resolve())
        print(f"{experiment.name}: {len(plans)} plans", file=sys.stderr)
        found.update(plans)
    if args.out:
        args.out.write_text(json.dumps(dict(sorted(found.items())), indent=1) + "\n")
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    missing = sorted(set(found) - set(before))
    changed = sorted(k for k in found if k in before and before[k] != found[k])
    for key in changed:
        print(f"changed: {key}: {before[key]} -> {found[key]}")
    for key in missing:
        print(f"not in {args.compare}: {key}")
    same = len(found) - len(changed) - len(missing)
    print(f"{same} of {len(found)} plan digests identical to {args.compare}")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
