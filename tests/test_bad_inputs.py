"""The CLI and config boundary under malformed input: every case in BAD_INPUTS must end with
exit status 2, exactly one line on stderr (`error: ...`, naming what is wrong), no traceback,
and no file written. Run in-process through the real entry point (`adaptiveload.cli.main`),
which is what the console script calls; each case gets fresh fixtures in its own folder.

A case is (id, argv, fixtures, expected substring of the error line). argv may use the
placeholders {cfg} {cal} {manifest} {plan} {plan_summary} {spool} {dir} {out}; {out} must
stay unwritten. Fixture kinds: `config` (overrides merged into a good micro experiment, or raw
text/bytes), `calibration` (overrides of a real calibration file, or raw text/bytes), `plan`
(an edit of a real plan table), `plan_summary` and `spool` (raw text/bytes).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from training_setup import ROOT

from adaptiveload.cli import main
from adaptiveload.planning.policies import POLICIES

GOOD_EXPERIMENT = {
    "name": "fuzz",
    "policies": list(POLICIES),
    "data": {"mixture": "tiny-cpu", "num_samples": 40},
    "model": {"config": "wan2.1-micro"},
    "budgets": {"m_tok": 2048, "m_mem": 2048, "m_comp": 60000, "p": 1.4},
    "train": {"world_size": 2, "steps": 2, "warmup_steps": 1, "checkpoint_every": 2},
}
H200 = ROOT / "experiments" / "calibration" / "h200-wan2.1-t2v-1.3b.json"
GARBAGE = bytes(range(256)) * 4  # not UTF-8: what a binary file given by mistake looks like
NAN, INF = math.nan, math.inf

TRAIN = ["train", "--config", "{cfg}", "--policy", "adaptiveload", "--seed", "0",
         "--out", "{out}/run", "--no-track"]
PLAN = ["plan", "--manifest", "{manifest}", "--policy", "adaptiveload", "--world-size", "2",
        "--seed", "0", "-o", "{out}/plan.parquet", "--summary", "{out}/plan.json",
        "--m-mem", "2048", "--m-comp", "60000", "--p", "1.4"]
SIMULATE = ["simulate", "--plan", "{plan}", "--calibration", "{cal}",
            "-o", "{out}/sim.parquet", "--summary", "{out}/sim.json"]


def _with(base: list[str], flag: str, value: str) -> list[str]:
    """`base` with `flag` set to `value` (replaced if present, else appended)."""
    args = list(base)
    if flag in args:
        args[args.index(flag) + 1] = value
        return args
    return [*args, flag, value]


def cfg(expect: str, **sections: dict[str, Any]) -> tuple[list[str], dict[str, Any], str]:
    return TRAIN, {"config": sections}, expect


BAD_INPUTS: list[tuple[str, list[str], dict[str, Any], str]] = [
    # --- experiment config: numbers JSON Schema bounds cannot catch, absurd sizes
    ("lr-nan", *cfg("train.lr", train={"lr": NAN})),
    ("lr-inf", *cfg("train.lr", train={"lr": INF})),
    ("lr-neg-inf", *cfg("train.lr", train={"lr": -INF})),
    ("lr-zero", *cfg("train.lr", train={"lr": 0})),
    ("lr-negative", *cfg("train.lr", train={"lr": -1e-4})),
    ("lr-huge", *cfg("train.lr", train={"lr": 1e9})),
    ("grad-clip-nan", *cfg("train.grad_clip", train={"grad_clip": NAN})),
    ("grad-clip-inf", *cfg("train.grad_clip", train={"grad_clip": INF})),
    ("timestep-shift-nan", *cfg("train.timestep_shift", train={"timestep_shift": NAN})),
    ("timestep-shift-inf", *cfg("train.timestep_shift", train={"timestep_shift": INF})),
    ("logit-std-nan", *cfg("train.logit_std", train={"logit_std": NAN})),
    ("weight-decay-nan", *cfg("train.weight_decay", train={"weight_decay": NAN})),
    ("allreduce-inf", *cfg("train.allreduce_gbps", train={"allreduce_gbps": INF})),
    ("num-samples-1e20", *cfg("data.num_samples", data={"num_samples": 1e20})),
    ("num-samples-zero", *cfg("data.num_samples", data={"num_samples": 0})),
    ("world-size-1e12", *cfg("train.world_size", train={"world_size": 1e12})),
    ("world-size-zero", *cfg("train.world_size", train={"world_size": 0})),
    ("steps-zero", *cfg("train.steps", train={"steps": 0})),
    ("steps-1e15", *cfg("train.steps", train={"steps": 1e15})),
    ("warmup-not-below-steps", *cfg("warmup_steps", train={"steps": 2, "warmup_steps": 2})),
    ("m-mem-1e308", *cfg("budgets.m_mem", budgets={"m_mem": 1e308})),
    ("m-comp-1e308", *cfg("budgets.m_comp", budgets={"m_comp": 1e308})),
    ("m-tok-inf", *cfg("budgets.m_tok", budgets={"m_tok": INF})),
    ("m-comp-nan", *cfg("budgets.m_comp", budgets={"m_comp": NAN})),
    ("m-mem-negative", *cfg("budgets.m_mem", budgets={"m_mem": -5})),
    ("p-nan", *cfg("budgets.p", budgets={"p": NAN})),
    ("p-out-of-range", *cfg("budgets.p", budgets={"p": 7})),
    ("capacity-nan", *cfg("calibration.capacity_gb", calibration={"capacity_gb": NAN})),
    ("unknown-train-field", *cfg("train", train={"learning_rate": 1e-3})),
    ("bad-grid", *cfg("data.grid", data={"grid": "huge"})),
    ("bad-sampling", *cfg("train.timestep_sampling", train={"timestep_sampling": "cosine"})),
    ("unknown-model", *cfg("wan9", model={"config": "wan9"})),
    ("unknown-mixture", *cfg("nope", data={"mixture": "nope"})),
    ("negative-config-seed", *cfg("seeds.0", seeds=[-1])),
    ("policy-not-in-config", *cfg("--policy adaptiveload", policies=["equal-token"])),
    # --- experiment config: the file itself
    ("duplicate-key-top", TRAIN, {"config": "name: a\nname: b\n"}, "key 'name' given twice"),
    ("duplicate-key-nested", TRAIN,
     {"config": "name: a\ntrain:\n  lr: 0.1\n  lr: 0.2\n"}, "key 'lr' given twice"),
    ("config-binary", TRAIN, {"config": GARBAGE}, "not UTF-8"),
    ("config-directory", _with(TRAIN, "--config", "{dir}"), {}, "directory"),
    ("config-missing", _with(TRAIN, "--config", "{dir}/nope.yaml"), {}, "not found"),
    ("config-empty", TRAIN, {"config": ""}, "mapping"),
    ("config-list", TRAIN, {"config": "- a\n- b\n"}, "mapping"),
    ("config-bad-yaml", TRAIN, {"config": "name: a\ntrain: [\n"}, "not valid YAML"),
    ("config-undefined-alias", TRAIN, {"config": "name: *nothing\n"}, "not valid YAML"),
    ("config-unknown-section", TRAIN, {"config": "name: a\nextra: 1\n"}, "(top level)"),
    ("config-no-name", TRAIN, {"config": "train: {steps: 3}\n"}, "name"),
    ("config-bad-name", TRAIN, {"config": "name: a/b\n"}, "name"),
    # --- train flags
    ("emulate-world-size-zero", _with(TRAIN, "--emulate-world-size", "0"), {"config": {}},
     "--emulate-world-size 0"),
    ("emulate-world-size-negative", _with(TRAIN, "--emulate-world-size", "-3"),
     {"config": {}}, "--emulate-world-size -3"),
    ("emulate-world-size-1e12", _with(TRAIN, "--emulate-world-size", "1000000000000"),
     {"config": {}}, "--emulate-world-size"),
    ("seed-negative", _with(TRAIN, "--seed", "-1"), {"config": {}}, "--seed"),
    ("seed-huge", _with(TRAIN, "--seed", "99999999999999999999"), {"config": {}}, "--seed"),
    ("policy-unknown", _with(TRAIN, "--policy", "bogus"), {"config": {}}, "--policy bogus"),
    ("steps-flag-zero", _with(TRAIN, "--steps", "0"), {"config": {}}, "steps"),
    ("steps-flag-negative", _with(TRAIN, "--steps", "-5"), {"config": {}}, "steps"),
    ("kernel-unknown", _with(TRAIN, "--kernel", "turbo"), {"config": {}}, "kernel"),
    ("device-unknown", _with(TRAIN, "--device", "tpu"), {"config": {}}, "device"),
    ("calibration-other-model", _with(TRAIN, "--calibration", str(H200)), {"config": {}},
     "not 'wan2.1-micro'"),
    ("calibration-other-shape", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": {"model": "wan2.1-micro"}}, "another shape"),
    ("calibration-binary", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": GARBAGE}, "not UTF-8"),
    ("calibration-directory", _with(TRAIN, "--calibration", "{dir}"), {"config": {}},
     "directory"),
    ("calibration-missing", _with(TRAIN, "--calibration", "{dir}/nope.json"), {"config": {}},
     "not found"),
    ("calibration-not-json", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": "{not json"}, "not valid JSON"),
    ("calibration-a-list", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": "[1, 2]"}, "JSON object"),
    ("calibration-missing-fields", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": '{"model": "wan2.1-micro"}'}, "missing field"),
    ("calibration-p-text", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": {"p": "abc"}}, "'p'"),
    ("calibration-m-mem-nan", _with(TRAIN, "--calibration", "{cal}"),
     {"config": {}, "calibration": {"m_mem": NAN}}, "'m_mem'"),
    ("manifest-missing", _with(TRAIN, "--manifest", "{dir}/nope.csv"), {"config": {}},
     "nope.csv"),
    ("manifest-directory", _with(TRAIN, "--manifest", "{dir}"), {"config": {}}, "{dir}"),
    ("train-plan-missing", _with(TRAIN, "--plan", "{dir}/nope.json"), {"config": {}},
     "nope.json"),
    ("train-plan-no-digest", _with(TRAIN, "--plan", "{plan_summary}"),
     {"config": {}, "plan_summary": '{"policy": "adaptiveload"}'}, "no field plan_digest"),
    ("train-plan-other-world-size", _with(TRAIN, "--plan", "{plan_summary}"),
     {"config": {}, "plan_summary": '{"world_size": 5, "plan_digest": "0"}'},
     "{plan_summary}: field world_size is 5 but this run plans 2"),
    ("train-plan-other-digest", _with(TRAIN, "--plan", "{plan_summary}"),
     {"config": {}, "plan_summary": '{"world_size": 2, "plan_digest": "0"}'},
     "field plan_digest is '0'"),
    # --- plan flags
    ("plan-m-mem-1e308", _with(PLAN, "--m-mem", "1e308"), {"manifest": True}, "m_mem"),
    ("plan-m-comp-1e308", _with(PLAN, "--m-comp", "1e308"), {"manifest": True}, "m_comp"),
    ("plan-m-comp-nan", _with(PLAN, "--m-comp", "nan"), {"manifest": True}, "m_comp"),
    ("plan-m-mem-text", _with(PLAN, "--m-mem", "lots"), {"manifest": True}, "m_mem"),
    ("plan-m-tok-inf", [*_with(PLAN, "--policy", "equal-token"), "--m-tok", "inf"],
     {"manifest": True}, "m_tok"),
    ("plan-p-out-of-range", _with(PLAN, "--p", "7"), {"manifest": True}, "p=7"),
    ("plan-world-size-zero", _with(PLAN, "--world-size", "0"), {"manifest": True},
     "world_size"),
    ("plan-seed-negative", _with(PLAN, "--seed", "-1"), {"manifest": True}, "seed"),
    ("plan-allreduce-zero", _with(PLAN, "--allreduce-gbps", "0"), {"manifest": True},
     "--allreduce-gbps"),
    ("plan-window-negative", _with(PLAN, "--window-steps", "-1"), {"manifest": True},
     "window_steps"),
    ("plan-calibration-other-model", [*PLAN, "--calibration", str(H200), "--model",
     "wan2.1-micro"], {"manifest": True}, "not 'wan2.1-micro'"),
    ("plan-manifest-missing", _with(PLAN, "--manifest", "{dir}/nope.csv"), {}, "nope.csv"),
    # --- plan tables given to simulate
    ("plan-duplicated-sample", SIMULATE, {"plan": "duplicate", "calibration": {}},
     "more than once"),
    ("plan-nan-tokens", SIMULATE, {"plan": ("tokens", NAN), "calibration": {}}, "tokens"),
    ("plan-1e12-tokens", SIMULATE, {"plan": ("tokens", 1e12), "calibration": {}}, "tokens"),
    ("plan-negative-step", SIMULATE, {"plan": ("step", -1), "calibration": {}}, "step"),
    ("plan-zero-height", SIMULATE, {"plan": ("height", 0), "calibration": {}}, "height"),
    ("plan-missing-column", SIMULATE, {"plan": "drop-rank", "calibration": {}}, "rank"),
    ("plan-binary", SIMULATE, {"plan": GARBAGE, "calibration": {}}, "Parquet"),
    ("plan-directory", _with(SIMULATE, "--plan", "{dir}"), {"calibration": {}}, "directory"),
    ("simulate-warmup-negative", [*SIMULATE, "--warmup-steps", "-1"],
     {"plan": "ok", "calibration": {}}, "--warmup-steps"),
    ("simulate-grad-bytes-negative", [*SIMULATE, "--grad-bytes", "-1"],
     {"plan": "ok", "calibration": {}}, "--grad-bytes"),
    ("simulate-calibration-directory", _with(SIMULATE, "--calibration", "{dir}"),
     {"plan": "ok"}, "directory"),
    # --- tracking spools
    ("spool-no-header", ["sync", "{spool}"], {"spool": '{"kind": "step"}\n'}, "header"),
    ("spool-binary", ["sync", "{spool}"], {"spool": GARBAGE}, "not UTF-8"),
    ("spool-torn-middle", ["sync", "{spool}"],
     {"spool": '{"kind": "run", "run_id": "x", "uri": "y"}\n{bad\n{"kind": "step"}\n'},
     "line 2"),
    ("spool-directory", ["sync", "{dir}"], {}, "directory"),
]


def _write(path: Path, content: str | bytes) -> None:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def _fixtures(tmp: Path, spec: dict[str, Any]) -> dict[str, str]:
    """Write the case's input files under tmp/in; return the argv placeholders."""
    inputs = tmp / "in"
    (inputs / "empty").mkdir(parents=True)
    paths = {
        "cfg": inputs / "exp.yaml", "cal": inputs / "cal.json", "manifest": inputs / "m.csv",
        "plan": inputs / "plan.parquet", "spool": inputs / "tracking.spool.jsonl",
        "plan_summary": inputs / "plan.json",
    }
    config = spec.get("config")
    if isinstance(config, dict):
        exp = copy.deepcopy(GOOD_EXPERIMENT)
        for section, values in config.items():
            if isinstance(values, dict):
                exp.setdefault(section, {}).update(values)
            else:
                exp[section] = values
        paths["cfg"].write_text(yaml.safe_dump(exp))
    elif config is not None:
        _write(paths["cfg"], config)
    cal = spec.get("calibration")
    if isinstance(cal, dict):
        paths["cal"].write_text(json.dumps({**json.loads(H200.read_text()), **cal}))
    elif cal is not None:
        _write(paths["cal"], cal)
    if spec.get("manifest") or "plan" in spec:
        from adaptiveload.data.manifest import write_manifest
        from adaptiveload.data.mixtures import synthesize

        write_manifest(paths["manifest"], synthesize("tiny-cpu", 40, 0))
    plan = spec.get("plan")
    if isinstance(plan, bytes):
        paths["plan"].write_bytes(plan)
    elif plan is not None:
        _plan_table(paths["manifest"], paths["plan"], plan)
    if "spool" in spec:
        _write(paths["spool"], spec["spool"])
    if "plan_summary" in spec:
        _write(paths["plan_summary"], spec["plan_summary"])
    return {**{k: str(v) for k, v in paths.items()}, "dir": str(inputs / "empty")}


def _plan_table(manifest: Path, path: Path, edit: Any) -> None:
    """A real plan of `manifest`, then one malformation."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.manifest import load_manifest
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import Budgets

    bucketed = bucketize(load_manifest(manifest), mode="aspect", grid="tiny", max_frames=81)
    budgets = Budgets(m_mem=2048, m_comp=60000, p=1.4)
    table = build_plan(bucketed, "adaptiveload", budgets, 2, 0).table
    if edit == "duplicate":
        table.loc[1, "sample_id"] = table.loc[0, "sample_id"]
        table.loc[[0, 1], "is_padding"] = False
    elif edit == "drop-rank":
        table = table.drop(columns=["rank"])
    elif isinstance(edit, tuple):
        column, value = edit
        table[column] = table[column].astype("float64")
        table.loc[0, column] = value
    pd.DataFrame(table).to_parquet(path, index=False)


def test_table_is_large_and_unique():
    ids = [case[0] for case in BAD_INPUTS]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 60


@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never' / 'mlflow.db'}")
    failures = []
    for case_id, argv, spec, expect in BAD_INPUTS:
        tmp = tmp_path / case_id
        placeholders = _fixtures(tmp, spec)
        out = tmp / "out"
        placeholders["out"] = str(out)
        args = [a.format(**placeholders) for a in argv]
        before = sorted(tmp.rglob("*"))
        monkeypatch.chdir(tmp)
        monkeypatch.setattr(sys, "argv", ["adaptiveload", *args])
        capsys.readouterr()
        try:
            main()
            code: Any = 0
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:  # a traceback in real life
            code = f"{type(exc).__name__}: {exc}"
        err = capsys.readouterr().err
        # one error line; an unusual plan met on the way may add `warning:` lines before it
        lines = [line for line in err.strip().splitlines() if not line.startswith("warning: ")]
        problems = []
        if code != 2:
            problems.append(f"exit {code!r}")
        if len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"stderr has {len(lines)} line(s): {err[-300:]!r}")
        elif expect.format(**placeholders) not in lines[0]:
            problems.append(f"{expect!r} not in {lines[0]!r}")
        if "Traceback" in err:
            problems.append("traceback")
        if sorted(tmp.rglob("*")) != before:
            problems.append(f"wrote {sorted(set(tmp.rglob('*')) - set(before))}")
        if problems:
            failures.append(f"{case_id}: {'; '.join(problems)}")
    with capsys.disabled():
        clean = len(BAD_INPUTS) - len(failures)
        print(f"\nbad inputs: {len(BAD_INPUTS)} cases, {clean} refused cleanly")
    assert not failures, "\n".join(failures)
