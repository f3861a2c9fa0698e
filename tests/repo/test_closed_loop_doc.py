"""docs/closed_loop.md's table is what tests/support/closed_loop_doc.py renders from the
committed results/benchmarks/closed_loop_model.json: no number in it is typed by hand."""

from __future__ import annotations

import json

from closed_loop_doc import generated_block, table
from repo_paths import ROOT


def test_the_closed_loop_doc_holds_the_table_of_the_committed_result():
    result = json.loads((ROOT / "results" / "benchmarks" / "closed_loop_model.json").read_text())
    assert generated_block(ROOT / "docs" / "closed_loop.md") == table(result)
    assert result["source"] == "model"
