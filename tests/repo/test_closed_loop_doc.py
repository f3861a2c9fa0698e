"""docs/closed_loop.md's model tables are what tests/support/closed_loop_doc.py renders from
the committed results/benchmarks/closed_loop_*.json (paper scale, its holdout, epochs of a few
steps): no number in them is typed by hand."""

from __future__ import annotations

from closed_loop_doc import MODEL, SHORT, generated_block, load, render_model, render_short
from repo_paths import ROOT


def test_the_closed_loop_doc_holds_the_tables_of_the_committed_results():
    results = load()
    doc = ROOT / "docs" / "closed_loop.md"
    assert generated_block(doc, MODEL) == render_model(results)
    assert generated_block(doc, SHORT) == render_short(results)
    assert all(result["source"] == "model" for result in results.values())
