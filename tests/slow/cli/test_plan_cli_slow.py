"""`adaptiveload plan` / `adaptiveload simulate` end to end, and their refusals."""

from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest
from training_setup import adaptiveload


def cli(*args: str) -> subprocess.CompletedProcess:
    return adaptiveload(*args, timeout=120)


@pytest.mark.parametrize("policy", ["adaptiveload", "adaptiveload-packed"])
def test_plan_writes_its_one_simulation_as_simulate_would(plan_inputs, policy):
    """`plan --simulation-steps/--simulation-summary` (the pipeline's simulations) writes what
    `simulate --plan` writes for the same plan, from the one simulation planning made; a plan
    file of packs (cells of several shapes) reads back the same."""
    root = plan_inputs["root"] / f"once-{policy}"
    root.mkdir()
    common = ["--manifest", str(plan_inputs["manifest"]), "--policy", policy, "--seed", "1",
              "--world-size", "8", "--calibration", str(plan_inputs["calibration"])]
    once = cli("plan", *common, "--simulation-steps", str(root / "once.parquet"),
               "--simulation-summary", str(root / "once.json"),
               "--experiment", "x")
    assert once.returncode == 0, once.stderr
    assert sorted(p.name for p in root.iterdir()) == ["once.json", "once.parquet"]
    twice = [cli("plan", *common, "-o", str(root / "p.parquet"), "--summary", str(root / "p.json")),
             cli("simulate", "--plan", str(root / "p.parquet"), "--calibration",
                 str(plan_inputs["calibration"]), "--experiment", "x",
                 "-o", str(root / "twice.parquet"), "--summary", str(root / "twice.json"))]
    assert all(done.returncode == 0 for done in twice), [d.stderr for d in twice]
    pd.testing.assert_frame_equal(pd.read_parquet(root / "once.parquet"),
                                  pd.read_parquet(root / "twice.parquet"))
    got, want = json.loads((root / "once.json").read_text()), json.loads(
        (root / "twice.json").read_text()
    )
    assert got.pop("plan")["plan_digest"] == want.pop("plan")["plan_digest"]
    assert got == want and got["warmup_steps"] == 0 and got["steps"] > 0


def test_plan_without_an_output_or_a_cost_model_to_simulate_is_refused(plan_inputs):
    common = ["--manifest", str(plan_inputs["manifest"]), "--policy", "equal-token", "--seed", "0",
              "--world-size", "4", "--m-tok", "5e4"]
    nothing = cli("plan", *common)
    assert nothing.returncode == 2 and "nothing to write" in nothing.stderr
    blind = cli("plan", *common, "--simulation-steps",
                str(plan_inputs["root"] / "s.parquet"))
    assert blind.returncode == 2 and "give --calibration" in blind.stderr
    assert not (plan_inputs["root"] / "s.parquet").exists()


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
def test_plan_refuses_bad_input_without_writing(plan_inputs, flags, message):
    out = plan_inputs["root"] / "refused"
    flags = [str(plan_inputs["calibration"]) if f == "CAL" else f for f in flags]
    if "--world-size" not in flags:
        flags += ["--world-size", "4"]
    done = cli(
        "plan",
        "--manifest",
        str(plan_inputs["manifest"]),
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


def test_sweep_flags_resolve_m_comp_from_the_calibrations_reference_batch(plan_inputs):
    """--p moves an auto M_comp along the reference batch (B_ref * S_ref^p), --m-comp-scale
    multiplies it; M_mem and M_tok stay the calibration's (the pipeline's p and M_comp sweeps)."""
    cal = json.loads(plan_inputs["calibration"].read_text())
    cal.update(m_tok=2 * 30_000, m_comp=2 * 30_000**1.36,
               budgets={"ref_tokens": 30_000, "ref_batch": 2})
    path = plan_inputs["root"] / "cal_ref.json"
    path.write_text(json.dumps(cal))

    def summary(*flags: str) -> dict:
        out = plan_inputs["root"] / "sweep.json"
        done = cli("plan", "--manifest", str(plan_inputs["manifest"]), "--policy", "adaptiveload",
                   "--world-size", "4", "--seed", "0", "--calibration", str(path), *flags,
                   "-o", str(plan_inputs["root"] / "sweep.parquet"), "--summary", str(out))
        assert done.returncode == 0, done.stderr
        return json.loads(out.read_text())

    base, swept, scaled = summary(), summary("--p", "1.8"), summary("--m-comp-scale", "0.5")
    assert base["m_comp"] == cal["m_comp"] and base["p"] == 1.36
    assert (swept["p"], swept["m_comp"]) == (1.8, 2 * 30_000**1.8)
    assert (scaled["p"], scaled["m_comp"]) == (1.36, 0.5 * cal["m_comp"])
    for s in (swept, scaled):
        assert (s["m_mem"], s["m_tok"]) == (base["m_mem"], base["m_tok"])


def test_simulate_refuses_a_missing_plan(plan_inputs):
    done = cli(
        "simulate",
        "--plan",
        str(plan_inputs["root"] / "nope.parquet"),
        "--calibration",
        str(plan_inputs["calibration"]),
        "--json",
    )
    assert done.returncode == 2 and "plan file not found" in done.stderr
