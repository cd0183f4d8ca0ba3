"""`kvpool demo` (what `make demo` runs) works end to end, says what it must and leaves no file behind."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_demo_prints_ttft_by_round_kvpool_tokens_a_cross_pod_hit_and_agreeing_outputs(tmp_path: Path) -> None:
    # the demo as a newcomer runs it: its own temporary directory (short: vLLM's socket paths), no
    # IPC directory from the test session
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    with tempfile.TemporaryDirectory(prefix="demo-") as tmp:
        r = subprocess.run(
            [sys.executable, "-m", "kvpool_demo.cli", "demo", "--model-dir", str(tmp_path / "m")],
            capture_output=True,
            text=True,
            timeout=900,
            env={**env, "TMPDIR": tmp},
        )
        # torch's compile cache is a cache, kept on purpose
        left = sorted(p.name for p in Path(tmp).iterdir() if not p.name.startswith("torchinductor_"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert left == [], f"the demo left {len(left)} files in its temporary directory: {left[:5]}"
    out = r.stdout
    rows = {line.split("|")[0].strip(): line.split("|") for line in out.splitlines() if line.count("|") == 3}
    assert {"1", "2", "3", "pod b"} <= rows.keys(), out
    for label in ("2", "3", "pod b"):  # returning users: their prefixes left vLLM's cache, kvpool has them
        assert int(rows[label][3].split()[0]) > 0, out
    assert "through Redis, written by pod a" in out
    assert "hit rate" in out
    assert "outputs agree: yes" in out
