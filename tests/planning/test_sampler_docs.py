"""docs/sampler.md holds every example the slow lane runs as written
(tests/slow/planning/test_sampler_docs_slow.py), each complete, with the calls it teaches."""

from __future__ import annotations

from docs_examples import SAMPLER_DOC, SAMPLER_EXAMPLES, examples


def test_doc_has_every_example():
    found = examples(SAMPLER_DOC)
    assert list(found) == list(SAMPLER_EXAMPLES)
    assert "use_distributed_sampler=False" in found["lightning_example.py"][1]
    assert "PlanDataLoader(" in found["lightning_example.py"][1]
    assert "rank=None" in found["accelerate_example.py"][1]
    assert "prepare(accelerator, " in found["accelerate_example.py"][1]
    assert "```python fragment" not in SAMPLER_DOC.read_text()  # every example runs
