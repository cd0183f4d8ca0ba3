"""A cache that fails on every step must not write a line on every step: one per kind per interval,
the next one saying how many were held back, the traceback kept for caught bugs."""

from __future__ import annotations

import logging

import pytest

from kvpool_connector.ratelimit import RateLimitedLog


def test_one_line_per_kind_per_interval_then_the_count_held_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    warn = RateLimitedLog(logging.getLogger("vllm.kvpool_test"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="vllm.kvpool_test"):
        for step in range(5):
            warn.warning("lookup", "lookup failed: %s", step)
        warn.warning("save", "save failed")
        now[0] += 10.0
        warn.warning("lookup", "lookup failed: %s", "again")
        try:
            raise RuntimeError("a bug")
        except RuntimeError:
            warn.exception("save-bug", "saving failed")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "lookup failed: 0",
        "save failed",
        "lookup failed: again (and 4 more like it since the last report)",
        "saving failed",
    ]
    bug = caplog.records[-1]
    assert bug.levelname == "ERROR" and bug.exc_info is not None and bug.exc_info[0] is RuntimeError
    assert {r.filename for r in caplog.records} == {"test_ratelimit.py"}  # the caller's line, not ours
