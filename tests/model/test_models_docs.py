"""docs/models.md holds every example the slow lane runs as written
(tests/slow/model/test_models_docs_slow.py)."""

from __future__ import annotations

from docs_examples import MODELS_DOC, MODELS_EXAMPLES, examples


def test_doc_has_every_example():
    assert list(examples(MODELS_DOC)) == list(MODELS_EXAMPLES)
