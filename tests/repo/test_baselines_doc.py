"""docs/baselines.md's tables are what tests/support/baselines_doc.py renders from the committed
results/benchmarks/baselines.json: no number in them is typed by hand."""

from __future__ import annotations

import json

from baselines_doc import generated_block, tables
from repo_paths import ROOT


def test_the_baselines_doc_holds_the_tables_of_the_committed_result():
    result = json.loads((ROOT / "results" / "benchmarks" / "baselines.json").read_text())
    assert generated_block(ROOT / "docs" / "baselines.md") == tables(result)
    assert result["source"] == "model"
