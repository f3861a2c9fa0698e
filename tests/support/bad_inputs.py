"""The table of malformed inputs at the CLI and config boundary (BAD_INPUTS): every case must
end with exit status 2, exactly one line on stderr (`error: ...`, naming what is wrong), no
traceback, and no file written (tests/slow/cli/test_bad_inputs_slow.py runs them all;
tests/cli/test_bad_inputs.py checks the table itself).

A case is (id, argv, fixtures, expected substring of the error line). argv may use the
placeholders {cfg} {cal} {manifest} {plan} {plan_summary} {spool} {dir} {out}; {out} must
stay unwritten. Fixture kinds: `config` (overrides merged into a good micro experiment, or raw
text/bytes), `calibration` (overrides of a real calibration file, or raw text/bytes), `plan`
(an edit of a real plan table), `plan_summary` and `spool` (raw text/bytes).
"""

from __future__ import annotations

import math
from typing import Any

from repo_paths import H200_PRIOR

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
    ("calibration-other-model", _with(TRAIN, "--calibration", str(H200_PRIOR)), {"config": {}},
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
    ("plan-calibration-other-model", [*PLAN, "--calibration", str(H200_PRIOR), "--model",
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
