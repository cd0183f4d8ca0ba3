"""A linear-attention hybrid (Qwen3-Next-style: gated delta net and full attention layers alternate) on
the real vLLM CPU engine with kvpool configured. Its gated delta net layers keep one running state per
request, not per-token KV, so a chunk of the attention layers' KV alone cannot be loaded. kvpool
turns itself off for such a model at start, with an error line naming what to do, and vLLM serves
it exactly as without a connector: an optional cache never stops an engine (a pod it was injected
into would otherwise crash-loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, engine_spec, kvpool_connector
from kvtest import start_sidecar

from kvpool_demo.tinymodel import TINY_GDN, make_model, random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

PROMPT = random_prompt(300, 512, seed=41)


def _serve(d: Path, name: str, model: Path, connector: dict[str, Any] | None) -> list[dict[str, Any]]:
    runs = [
        {"label": "first", "prompts": [PROMPT], "max_tokens": 6},
        {"label": "again", "prompts": [PROMPT], "max_tokens": 6, "reset_prefix_cache": "engine"},
    ]
    engine = Engine(d, name, {})
    engine.spec = engine_spec(
        model, connector, runs, dtype="bfloat16", max_num_batched_tokens=None, enable_prefix_caching=True
    )
    engine.start()
    try:
        outs = [engine.wait_done(label)["outputs"][0] for label in ("first", "again")]
        engine.finish()
        return outs
    finally:
        engine.kill()


def test_kvpool_turns_itself_off_for_a_model_with_recurrent_state_and_vllm_serves_it(tmp_path) -> None:
    model = make_model(tmp_path / "tiny-qwen3-next", TINY_GDN)
    alone = _serve(tmp_path, "alone", model, None)
    sidecar = start_sidecar(tmp_path / "sidecar", "64Mi")
    try:
        client = SidecarClient(sidecar.info["url"], timeout=5)
        served = _serve(tmp_path, "kvpool", model, kvpool_connector(sidecar.info["url"]))
        stats = client.stats()
    finally:
        sidecar.stop()
    for mine, ref in zip(served, alone, strict=True):
        assert mine["token_ids"] == ref["token_ids"]
        assert mine["logprobs"] == ref["logprobs"]  # as without a connector, bit for bit
    assert stats["hits"] + stats["misses"] == 0 and stats["chunks"] == 0  # never asked, never saved
    (report,) = stats["engines"].values()  # what the pool's status reads (CacheOff)
    assert report["cache"] == "off" and "MambaSpec" in report["reason"], report
    log = (tmp_path / "kvpool.log").read_text()
    assert "kvpool cannot cache a model with state that is not per-token KV (MambaSpec" in log
    assert "kvpool is off for this engine" in log
    assert 'kvpool.dev/inject: "false"' in log
