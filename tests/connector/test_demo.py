"""`kvpool demo` (what `make demo` runs) works end to end and says what it must."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_demo_prints_ttft_by_round_kvpool_tokens_a_cross_pod_hit_and_agreeing_outputs(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvpool_demo.cli", "demo", "--model-dir", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    rows = {line.split("|")[0].strip(): line.split("|") for line in out.splitlines() if line.count("|") == 3}
    assert {"1", "2", "3", "pod b"} <= rows.keys(), out
    for label in ("2", "3", "pod b"):  # returning users: their prefixes left vLLM's cache, kvpool has them
        assert int(rows[label][3].split()[0]) > 0, out
    assert "through Redis, written by pod a" in out
    assert "hit rate" in out
    assert "outputs agree: yes" in out
