"""`adaptiveload plan` / `adaptiveload simulate` end to end, and their refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from adaptiveload.planning.plan import TABLE_COLUMNS
from adaptiveload.step_table import STEP_COLUMNS

SUMMARY_KEYS = [
    "policy",
    "world_size",
    "num_samples",
    "num_planned",
    "num_excluded",
    "num_oversize",
    "num_padding",
    "duplicates",
    "steps",
    "batches",
    "max_tokens_per_batch",
    "constraint_violations",
    "m_tok",
    "m_mem",
    "m_comp",
    "p",
]
PREDICTED = (
    "predicted_imbalance_rate",
    "predicted_idle_fraction",
    "predicted_samples_per_s",
    "predicted_tokens_per_s",
)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adaptiveload", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    from adaptiveload.data.manifest import write_manifest
    from adaptiveload.data.mixtures import synthesize

    root = tmp_path_factory.mktemp("plan_cli")
    manifest = root / "manifest.parquet"
    write_manifest(manifest, synthesize("paper-mixed", 800, seed=0))
    calibration = root / "cal.json"
    calibration.write_text(
        json.dumps(
            {
                "model": "wan2.1-t2v-1.3b",
                "device": "H200",
                "source": "model",
                "cost": {
                    "c0": 0.02,
                    "a": 1.6e-5,
                    "b": 1.1e-9,
                    "m_static": 2e10,
                    "m_tok": 1.5e6,
                    "m_seq": 1e6,
                },
                "p": 1.36,
                "m_mem": 80_000,
                "m_comp": 75_600**1.36,
                "capacity_bytes": 1.4e11,
                "num_params": 1.3e9,
            }
        )
    )
    return {"root": root, "manifest": manifest, "calibration": calibration}


def test_plan_then_simulate(inputs):
    root = inputs["root"]
    plan, summary = root / "plan.parquet", root / "summary.json"
    done = cli(
        "plan",
        "--manifest",
        str(inputs["manifest"]),
        "--policy",
        "adaptiveload-balanced",
        "--world-size",
        "8",
        "--seed",
        "3",
        "--epoch",
        "1",
        "--calibration",
        str(inputs["calibration"]),
        "--model",
        "wan2.1-t2v-1.3b",
        "-o",
        str(plan),
        "--summary",
        str(summary),
    )
    assert done.returncode == 0, done.stderr
    table = pd.read_parquet(plan)
    assert list(table.columns) == list(TABLE_COLUMNS)
    s = json.loads(summary.read_text())
    assert set(SUMMARY_KEYS) | set(PREDICTED) <= set(s)
    assert (s["world_size"], s["seed"], s["epoch"], s["num_samples"]) == (8, 3, 1, 800)
    assert s["m_tok"] == s["m_mem"] == 80_000 and s["predicted_source"] == "model"
    assert 0 < s["predicted_vram_utilization_mean"] <= s["predicted_vram_utilization_max"]
    assert s["num_planned"] + s["num_excluded"] == 800 and s["duplicates"] == 0

    steps, run = root / "steps.parquet", root / "run.json"
    done = cli(
        "simulate",
        "--plan",
        str(plan),
        "--calibration",
        str(inputs["calibration"]),
        "--allreduce-gbps",
        "400",
        "--json",
        "-o",
        str(steps),
        "--summary",
        str(run),
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads(run.read_text())
    assert printed["policy"] == "adaptiveload-balanced" and printed["source"] == "model"
    assert printed["imbalance_rate"] == pytest.approx(s["predicted_imbalance_rate"])
    assert printed["allreduce_s"] == pytest.approx(2 * 7 / 8 * 5.2e9 / 50e9)
    per_step = pd.read_parquet(steps)
    assert list(per_step.columns) == list(STEP_COLUMNS) and len(per_step) == s["steps"] * 8


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["adaptiveload", "adaptiveload-packed"])
def test_plan_writes_its_one_simulation_as_simulate_would(inputs, policy):
    """`plan --simulation-steps/--simulation-summary` (the pipeline's simulations) writes what
    `simulate --plan` writes for the same plan, from the one simulation planning made; a plan
    file of packs (cells of several shapes) reads back the same."""
    root = inputs["root"] / f"once-{policy}"
    root.mkdir()
    common = ["--manifest", str(inputs["manifest"]), "--policy", policy, "--seed", "1",
              "--world-size", "8", "--calibration", str(inputs["calibration"])]
    once = cli("plan", *common, "--simulation-steps", str(root / "once.parquet"),
               "--simulation-summary", str(root / "once.json"), "--warmup-steps", "2",
               "--experiment", "x")
    assert once.returncode == 0, once.stderr
    assert sorted(p.name for p in root.iterdir()) == ["once.json", "once.parquet"]
    twice = [cli("plan", *common, "-o", str(root / "p.parquet"), "--summary", str(root / "p.json")),
             cli("simulate", "--plan", str(root / "p.parquet"), "--calibration",
                 str(inputs["calibration"]), "--warmup-steps", "2", "--experiment", "x",
                 "-o", str(root / "twice.parquet"), "--summary", str(root / "twice.json"))]
    assert all(done.returncode == 0 for done in twice), [d.stderr for d in twice]
    pd.testing.assert_frame_equal(pd.read_parquet(root / "once.parquet"),
                                  pd.read_parquet(root / "twice.parquet"))
    got, want = json.loads((root / "once.json").read_text()), json.loads(
        (root / "twice.json").read_text()
    )
    assert got.pop("plan")["plan_digest"] == want.pop("plan")["plan_digest"]
    assert got == want and got["warmup_steps"] == 2 and got["steps"] > 0


@pytest.mark.slow
def test_plan_without_an_output_or_a_cost_model_to_simulate_is_refused(inputs):
    common = ["--manifest", str(inputs["manifest"]), "--policy", "equal-token", "--seed", "0",
              "--world-size", "4", "--m-tok", "5e4"]
    nothing = cli("plan", *common)
    assert nothing.returncode == 2 and "nothing to write" in nothing.stderr
    blind = cli("plan", *common, "--simulation-steps", str(inputs["root"] / "s.parquet"))
    assert blind.returncode == 2 and "give --calibration" in blind.stderr
    assert not (inputs["root"] / "s.parquet").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "adaptiveload", "--m-mem", "1e5", "--m-comp", "1e7", "--p", "3.5"], "p=3.5"),
        (["--policy", "equal-token", "--m-tok", "-5"], "m_tok=-5"),
        (["--policy", "equal-token", "--m-tok", "5e4", "--world-size", "0"], "world_size=0"),
        (["--policy", "fastest", "--m-tok", "5e4"], "unknown"),
        (["--policy", "adaptiveload", "--m-mem", "5e4"], "m_comp, p not set; give --m-comp, --p"),
        (
            ["--policy", "adaptiveload", "--calibration", "CAL", "--model", "wan2.1-t2v-14b"],
            "not 'wan2.1-t2v-14b'",
        ),
        # the fixture's calibration records no reference batch: M_comp cannot follow p
        (["--policy", "adaptiveload", "--calibration", "CAL", "--p", "1.6"], "no reference batch"),
        (
            [
                "--policy", "adaptiveload", "--m-mem", "1e5", "--m-comp", "1e7",
                "--m-comp-scale", "2",
            ],
            "m_comp_scale=2.0 scales the calibration's M_comp",
        ),
    ],
)
@pytest.mark.slow
def test_plan_refuses_bad_input_without_writing(inputs, flags, message):
    out = inputs["root"] / "refused"
    flags = [str(inputs["calibration"]) if f == "CAL" else f for f in flags]
    if "--world-size" not in flags:
        flags += ["--world-size", "4"]
    done = cli(
        "plan",
        "--manifest",
        str(inputs["manifest"]),
        "--seed",
        "0",
        *flags,
        "-o",
        str(out / "plan.parquet"),
        "--summary",
        str(out / "s.json"),
    )
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.slow
def test_sweep_flags_resolve_m_comp_from_the_calibrations_reference_batch(inputs):
    """--p moves an auto M_comp along the reference batch (B_ref * S_ref^p), --m-comp-scale
    multiplies it; M_mem and M_tok stay the calibration's (the pipeline's p and M_comp sweeps)."""
    cal = json.loads(inputs["calibration"].read_text())
    cal.update(m_tok=2 * 30_000, m_comp=2 * 30_000**1.36,
               budgets={"ref_tokens": 30_000, "ref_batch": 2})
    path = inputs["root"] / "cal_ref.json"
    path.write_text(json.dumps(cal))

    def summary(*flags: str) -> dict:
        out = inputs["root"] / "sweep.json"
        done = cli("plan", "--manifest", str(inputs["manifest"]), "--policy", "adaptiveload",
                   "--world-size", "4", "--seed", "0", "--calibration", str(path), *flags,
                   "-o", str(inputs["root"] / "sweep.parquet"), "--summary", str(out))
        assert done.returncode == 0, done.stderr
        return json.loads(out.read_text())

    base, swept, scaled = summary(), summary("--p", "1.8"), summary("--m-comp-scale", "0.5")
    assert base["m_comp"] == cal["m_comp"] and base["p"] == 1.36
    assert (swept["p"], swept["m_comp"]) == (1.8, 2 * 30_000**1.8)
    assert (scaled["p"], scaled["m_comp"]) == (1.36, 0.5 * cal["m_comp"])
    for s in (swept, scaled):
        assert (s["m_mem"], s["m_tok"]) == (base["m_mem"], base["m_tok"])


@pytest.mark.slow
def test_simulate_refuses_a_missing_plan(inputs):
    done = cli(
        "simulate",
        "--plan",
        str(inputs["root"] / "nope.parquet"),
        "--calibration",
        str(inputs["calibration"]),
        "--json",
    )
    assert done.returncode == 2 and "plan file not found" in done.stderr


def test_pack_tokens_caps_every_pack(inputs):
    out = inputs["root"] / "capped"
    done = cli("plan", "--manifest", str(inputs["manifest"]), "--policy", "adaptiveload-packed",
               "--seed", "0", "--world-size", "4", "--calibration", str(inputs["calibration"]),
               "--pack-tokens", "60000", "-o", str(out.with_suffix(".parquet")),
               "--summary", str(out.with_suffix(".json")))
    assert done.returncode == 0, done.stderr
    assert " packs, " in done.stdout and "x the steps' lower bound" in done.stdout
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["pack_tokens"] == 60000 and summary["pack_limits"]["tokens"] == 60000
    table = pd.read_parquet(out.with_suffix(".parquet"))
    sums = table.groupby("batch_id").agg(n=("tokens", "size"), s=("tokens", "sum"))
    assert (sums.loc[sums["n"] > 1, "s"] <= 60000).all()
