"""The CLI and config boundary under malformed input: every case of the table
(tests/support/bad_inputs.py: BAD_INPUTS) must end with exit status 2, exactly one line on
stderr (`error: ...`, naming what is wrong), no traceback, and no file written. Run
in-process through the real entry point (`adaptiveload.cli.main`), which is what the console
script calls; each case gets fresh fixtures in its own folder."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from bad_inputs import BAD_INPUTS
from repo_paths import H200_PRIOR

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
        paths["cal"].write_text(json.dumps({**json.loads(H200_PRIOR.read_text()), **cal}))
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
