"""docs/closed_loop.md's measured table is what tests/support/closed_loop_cpu_doc.py renders
from the committed results/benchmarks/closed_loop_cpu*.json: no number in it typed by hand."""

from __future__ import annotations

import json

from closed_loop_cpu_doc import RESULTS, generated_block, render
from repo_paths import ROOT


def test_the_closed_loop_doc_holds_the_measured_table_of_the_committed_result():
    results = [json.loads(p.read_text()) for p in RESULTS]
    assert generated_block(ROOT / "docs" / "closed_loop.md") == render(results)
    assert all(r["source"] == "measured" for r in results)
