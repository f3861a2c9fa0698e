"""The table of malformed inputs (tests/support/bad_inputs.py) is large and names each case
once; tests/slow/cli/test_bad_inputs_slow.py runs every case through the CLI."""

from __future__ import annotations

from bad_inputs import BAD_INPUTS


def test_table_is_large_and_unique():
    ids = [case[0] for case in BAD_INPUTS]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 60
