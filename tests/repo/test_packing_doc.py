"""docs/packing.md's tables and the README's summary of sequence-parallel plans are what
tests/support/packing_doc.py renders from the committed results/benchmarks (epoch_bound.json,
sp_plans.json, planning_sp.json): no number in them is typed by hand, and each benchmark says
whether it is a model's or measured."""

from __future__ import annotations

from packing_doc import blocks, generated_block, load


def test_the_packing_doc_holds_the_tables_of_the_committed_results():
    for path, markers, body in blocks():
        assert generated_block(path.read_text(), markers) == body, (path.name, markers[0])
    assert load("epoch_bound.json")["source"] == load("sp_plans.json")["source"] == "model"
    assert load("planning_sp.json")["source"] == "measured"
