"""The README's and docs/results.md's results are generated from the committed recorded runs
(`adaptiveload analyze publish`), never typed: this fails when a text and the records
disagree, or when a text has lost its generated blocks."""

from __future__ import annotations

from repo_paths import CONVERGENCE_BENCHMARK, DEFAULT_RECORDS, GENERATED_DOCS

from adaptiveload.analysis import headline


def test_generated_numbers_match_the_recorded_runs():
    generated = headline.generated_blocks(DEFAULT_RECORDS, CONVERGENCE_BENCHMARK)
    for path in GENERATED_DOCS:
        text = path.read_text(encoding="utf-8")
        names = {m.group("name") for m in headline.BLOCK.finditer(text)}
        assert {"headline:measured", "reruns"} & names, f"{path}: no generated results block"
        assert headline.fill(text, generated, str(path)) == text, (
            f"{path}: its numbers differ from {DEFAULT_RECORDS}; run `adaptiveload analyze "
            "publish` and commit the result")
