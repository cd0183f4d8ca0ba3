"""`kvpool demo` (what `make demo` runs) works end to end and says what it must."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_demo_prints_ttft_hit_rate_and_identical_outputs(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvpool_connector.cli", "demo", "--model-dir", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "time to first token    cold" in out and "warm" in out
    assert "loaded from kvpool     2048 tokens" in out
    assert "hit rate" in out
    assert "outputs identical      yes" in out
