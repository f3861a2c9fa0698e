"""The planner on a user's data from the command line: `compare` (every policy side by side),
`plan --budgets` (the p and budgets `budgets` derived for that data), budgets below every
sample (a warning, or a refusal with --strict), shipped calibrations by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run

from adaptiveload.data.manifest import write_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.planning.policies import POLICIES


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A user's CSV: string ids, images without fps, clips of every length."""
    folder = tmp_path_factory.mktemp("mine")
    frame = synthesize("paper-mixed", 1500, seed=4)
    frame["sample_id"] = [f"clip/{i:05d}.mp4" for i in range(len(frame))]
    write_manifest(folder / "mine.csv", frame)
    tiny = synthesize("tiny-cpu", 200, seed=1)
    write_manifest(folder / "tiny.csv", tiny)
    return folder


def test_compare_prints_and_writes_every_policy(data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "compare.json"
    code, stdout, err = run(
        monkeypatch, capsys, "compare", "--manifest", str(data / "mine.csv"), "--world-size",
        "8", "--calibration", "h200-wan2.1-t2v-1.3b", "-o", str(out),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    names = [s["policy"] for s in report["policies"]]
    assert names == list(POLICIES)  # the registry, so a new policy appears by itself
    for s in report["policies"]:
        assert s["predicted_source"] == "model"
        for key in ("imbalance_rate", "idle_fraction", "samples_per_s", "vram_utilization_mean"):
            assert 0 <= s[f"predicted_{key}"] < float("inf")
        assert s["p"] == pytest.approx(report["budgets"]["p"])  # the budgets shown are used
    assert report["calibration"]["capacity_gb"] == pytest.approx(141, rel=0.01)
    for name in names:
        assert any(line.startswith(name + " ") for line in stdout.splitlines()), stdout
    assert "budgets: p=" in stdout and "all predicted (model" in stdout
    # the balanced dealing is what cuts imbalance on this mix, and the table says so
    by = {s["policy"]: s for s in report["policies"]}
    assert by["adaptiveload-balanced"]["predicted_imbalance_rate"] < 0.5 * (
        by["equal-token"]["predicted_imbalance_rate"]
    )


def test_compare_runs_the_fields_methods_at_equal_tokens_steps(data, tmp_path, monkeypatch,
                                                                 capsys):
    """--policies picks the field's methods beside packed; --steps-per-epoch match plans each
    at equal-token's step count, and their micro-batches stay within the memory limit."""
    out = tmp_path / "peers.json"
    peers = [name for name, policy in POLICIES.items() if policy.peer]
    code, stdout, err = run(
        monkeypatch, capsys, "compare", "--manifest", str(data / "mine.csv"), "--world-size",
        "8", "--calibration", "h200-wan2.1-t2v-1.3b-measured", "--steps-per-epoch", "match",
        "--policies", ",".join(["equal-token", "adaptiveload-packed", *peers]), "-o", str(out),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["steps_per_epoch"] == "match" and "steps per epoch match" in stdout
    rows = report["policies"]
    assert [s["policy"] for s in rows] == ["equal-token", "adaptiveload-packed", *peers]
    assert len({s["steps"] for s in rows}) == 1
    assert all(s["constraint_violations"] == 0 for s in rows)


def test_compare_with_a_prior_honours_capacity(data, monkeypatch, capsys, tmp_path):
    reports = {}
    for gb in ("141", "80"):
        out = tmp_path / f"c{gb}.json"
        code, _, err = run(
            monkeypatch, capsys, "compare", "--manifest", str(data / "mine.csv"),
            "--world-size", "8", "--prior", "h200", "--model", "wan2.1-t2v-1.3b",
            "--capacity-gb", gb, "--policies", "equal-token,adaptiveload", "-o", str(out),
        )
        assert code == 0, err
        reports[gb] = json.loads(out.read_text())
    assert reports["80"]["calibration"]["capacity_gb"] == pytest.approx(80)
    assert reports["80"]["budgets"]["m_mem"] < 0.7 * reports["141"]["budgets"]["m_mem"]
    assert [s["policy"] for s in reports["80"]["policies"]] == ["equal-token", "adaptiveload"]


def test_compare_keeps_short_clips_as_video_where_asked(data, monkeypatch, capsys):
    """`compare` buckets as `plan` and the sampler do: short clips are stills by default,
    said once; --short-clips video keeps them as clips, and nothing is said."""
    said = {}
    for choice in ("still", "video"):
        code, _, err = run(
            monkeypatch, capsys, "compare", "--manifest", str(data / "mine.csv"),
            "--world-size", "8", "--calibration", "h200-wan2.1-t2v-1.3b",
            "--policies", "equal-token", "--short-clips", choice,
        )
        assert code == 0, err
        said[choice] = "below the grid's first video rung" in err
    assert said == {"still": True, "video": False}


def test_plan_reads_the_budgets_file_and_its_p(data, tmp_path, monkeypatch, capsys):
    """`budgets` derives p for the user's data; `plan --calibration` used the file's own p
    (that of the mix the calibration was made for), and could not read the budgets back."""
    code, stdout, err = run(
        monkeypatch, capsys, "budgets", "--calibration", "h200-wan2.1-t2v-1.3b", "--manifest",
        str(data / "tiny.csv"), "--grid", "tiny", "--capacity-gb", "40",
    )
    assert code == 0, err
    budgets = tmp_path / "budgets.json"
    budgets.write_text(stdout)
    derived = json.loads(stdout)
    summary = tmp_path / "plan.json"
    code, _, err = run(
        monkeypatch, capsys, "plan", "--manifest", str(data / "tiny.csv"), "--grid", "tiny",
        "--policy", "adaptiveload", "--world-size", "4", "--seed", "0", "--budgets",
        str(budgets), "-o", str(tmp_path / "plan.parquet"), "--summary", str(summary),
    )
    assert code == 0, err
    planned = json.loads(summary.read_text())
    for key in ("p", "m_mem", "m_comp", "m_tok"):
        assert planned[key] == pytest.approx(derived[key])
    from adaptiveload.costmodel import Calibration

    assert planned["p"] != pytest.approx(Calibration.load("h200-wan2.1-t2v-1.3b").p, abs=1e-3)
    assert "predicted_vram_utilization_mean" in planned  # at the budgets' 40 GB
    budgets.write_text(json.dumps({**derived, "model": "wan2.1-t2v-14b"}))
    code, _, err = run(
        monkeypatch, capsys, "plan", "--manifest", str(data / "tiny.csv"), "--grid", "tiny",
        "--policy", "adaptiveload", "--world-size", "4", "--seed", "0", "--budgets",
        str(budgets), "--calibration", "h200-wan2.1-t2v-1.3b", "-o", str(tmp_path / "x.pq"),
        "--summary", str(tmp_path / "x.json"),
    )
    assert code == 2 and "derived for model 'wan2.1-t2v-14b'" in err


def test_budget_below_every_sample_warns_or_refuses(data, tmp_path, monkeypatch, capsys):
    """`plan --m-tok 10` (below every sample) exited 0 with every batch oversize, silently."""
    args = ["plan", "--manifest", str(data / "tiny.csv"), "--grid", "tiny", "--policy",
            "equal-token", "--world-size", "4", "--seed", "0", "--m-tok", "10"]
    plan = tmp_path / "plan.parquet"
    code, _, err = run(monkeypatch, capsys, *args, "-o", str(plan), "--summary",
                       str(tmp_path / "s.json"))
    assert code == 0 and plan.exists()
    (line,) = [w for w in err.strip().splitlines() if not w.startswith("note: ")]
    assert line.startswith("warning: plan (equal-token): every sample exceeds")
    assert "m_tok=10" in line and "(the smallest has " in line
    strict = tmp_path / "strict.parquet"
    code, _, err = run(monkeypatch, capsys, *args, "-o", str(strict), "--summary",
                       str(tmp_path / "t.json"), "--strict")
    assert code == 2 and not strict.exists() and not (tmp_path / "t.json").exists()
    assert err.startswith("error: plan (equal-token): every sample exceeds")


def test_missing_budgets_say_how_to_get_them(data, tmp_path, monkeypatch, capsys):
    code, _, err = run(
        monkeypatch, capsys, "plan", "--manifest", str(data / "tiny.csv"), "--policy",
        "adaptiveload", "--world-size", "4", "--seed", "0", "-o", str(tmp_path / "p.pq"),
        "--summary", str(tmp_path / "p.json"),
    )
    assert code == 2
    for hint in ("--m-mem", "--budgets FILE", "adaptiveload budgets", "h200-wan2.1-t2v-1.3b",
                 "calibrate prior --rates h200"):
        assert hint in err, err


def test_unknown_calibration_name_lists_the_shipped(tmp_path, monkeypatch, capsys):
    code, _, err = run(monkeypatch, capsys, "compare", "--mixture", "tiny-cpu", "--world-size",
                       "2", "--calibration", "h100-nope")
    assert code == 2 and "h200-wan2.1-t2v-1.3b-measured" in err and "\n" not in err.strip()


def test_plan_and_compare_use_one_budget_rule(data, tmp_path, monkeypatch, capsys):
    """`plan --calibration X` planned with X's own p where `compare --calibration X` derived
    another for the data: the same flag planned differently. Now both take the calibration's
    own budgets, and both take the ones derived for the data from `--budgets FILE`."""
    manifest = str(data / "tiny.csv")
    common = ("--manifest", manifest, "--world-size", "4", "--grid", "tiny")
    code, stdout, _ = run(monkeypatch, capsys, "budgets", "--calibration",
                          "h200-wan2.1-t2v-1.3b", "--manifest", manifest, "--grid", "tiny")
    assert code == 0
    derived = tmp_path / "budgets.json"
    derived.write_text(stdout)
    for extra in ((), ("--budgets", str(derived))):
        summary, report = tmp_path / "plan.json", tmp_path / "compare.json"
        code, _, err = run(monkeypatch, capsys, "plan", *common, "--policy", "adaptiveload",
                           "--seed", "0", "--calibration", "h200-wan2.1-t2v-1.3b", *extra,
                           "--summary", str(summary))
        assert code == 0, err
        code, _, err = run(monkeypatch, capsys, "compare", *common, "--calibration",
                           "h200-wan2.1-t2v-1.3b", "--policies", "adaptiveload", *extra,
                           "-o", str(report))
        assert code == 0, err
        planned, compared = json.loads(summary.read_text()), json.loads(report.read_text())
        for key in ("p", "m_mem", "m_comp", "m_tok"):
            assert compared["budgets"][key] == pytest.approx(planned[key]), (extra, key)
        assert compared["policies"][0]["plan_digest"] == planned["plan_digest"]
    assert json.loads(derived.read_text())["p"] == pytest.approx(planned["p"])  # the last
    code, _, err = run(monkeypatch, capsys, "compare", *common, "--calibration",
                       "h200-wan2.1-t2v-1.3b", "--capacity-gb", "40")
    assert code == 2 and "--budgets budgets.json" in err and "\n" not in err.strip()


def test_cli_names_excluded_ids_and_counts_over_capacity(tmp_path, monkeypatch, capsys):
    """`compare --bucketing exact` warned of samples excluded (over the device's capacity)
    while its header said `0 excluded`; neither command named them."""
    frame = synthesize("paper-mixed", 300, seed=2)
    frame["height"] = frame["height"].clip(upper=480)  # the rest fits on one device
    frame["width"] = frame["width"].clip(upper=832)
    frame.loc[[7, 19], ["num_frames", "height", "width"]] = [1201, 2160, 3840]  # 4K, 1200 frames
    frame.loc[7, "sample_id"], frame.loc[19, "sample_id"] = "huge-a", "huge-b"
    write_manifest(tmp_path / "m.csv", frame)
    common = ("--manifest", str(tmp_path / "m.csv"), "--world-size", "4", "--bucketing",
              "exact", "--calibration", "h200-wan2.1-t2v-1.3b")
    code, stdout, err = run(monkeypatch, capsys, "compare", *common, "--policies", "adaptiveload")
    assert code == 0, err
    assert "300 samples (2 excluded)" in stdout.splitlines()[0]
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "2 of 300 samples excluded" in warning[0]
    assert "'huge-a', 'huge-b'" in warning[0] and "over the device's capacity" in warning[0]
    code, _, err = run(monkeypatch, capsys, "plan", *common, "--policy", "adaptiveload",
                       "--seed", "0", "--summary", str(tmp_path / "p.json"))
    assert code == 0 and "'huge-a', 'huge-b'" in err
    assert json.loads((tmp_path / "p.json").read_text())["num_over_capacity"] == 2
