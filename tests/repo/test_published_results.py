"""The README's, docs/results.md's and docs/baselines.md's results are generated from the
committed recorded runs (`adaptiveload analyze publish`), never typed: this fails when a text
and the records disagree, or when a text has lost its generated blocks."""

from __future__ import annotations

import pytest
from repo_paths import (
    BASELINES_DOC,
    BASELINES_RECORDS,
    CONVERGENCE_BENCHMARK,
    DEFAULT_RECORDS,
    GENERATED_DOCS,
)

from adaptiveload.analysis import headline

PUBLISHED = [(DEFAULT_RECORDS, "equal-token", doc) for doc in GENERATED_DOCS] + [
    (BASELINES_RECORDS, "adaptiveload-packed", BASELINES_DOC)]


@pytest.mark.parametrize(("records", "baseline", "path"), PUBLISHED,
                         ids=[p.name for *_, p in PUBLISHED])
def test_generated_numbers_match_the_recorded_runs(records, baseline, path):
    generated = headline.generated_blocks(records, CONVERGENCE_BENCHMARK, baseline)
    text = path.read_text(encoding="utf-8")
    names = {m.group("name") for m in headline.BLOCK.finditer(text)}
    assert {"headline:measured", "headline:train", "reruns"} & names, (
        f"{path}: no generated results block")
    assert headline.fill(text, generated, str(path)) == text, (
        f"{path}: its numbers differ from {records}; run `adaptiveload analyze publish` and "
        "commit the result")
