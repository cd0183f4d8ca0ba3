"""A weight update never serves KV of the old weights (the RL weight-sync flow): new weights loaded in
place, then reset_prefix_cache(reset_connector=True), which vLLM's pause_generation(clear_cache=True)
and /reset_prefix_cache?reset_external=true call.

The real vLLM CPU engine in-process (new token embeddings are loaded through apply_model), prefix
caching on, a real sidecar. The reference is the same prompt with a cache salt of its own after the
update: computed from nothing with the new weights, as a fresh engine would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, engine_spec, kvpool_connector
from kvtest import start_sidecar

from kvpool_demo.tinymodel import random_prompt

pytestmark = pytest.mark.engine

P = random_prompt(450, 512, seed=91)


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    d = tmp_path_factory.mktemp("weights")
    sidecar = start_sidecar(d, "64Mi")
    runs = [
        {"label": "old", "prompts": [P], "max_tokens": 6},
        {
            "label": "update",
            "prompts": [P],
            "max_tokens": 6,
            "new_embeddings_seed": 7,
            "reset_prefix_cache": "connector",
        },
        {"label": "fresh", "prompts": [P], "max_tokens": 6, "cache_salt": "fresh"},
        # vLLM's own cache reset only: what kvpool serves now is what it saved after the update
        {"label": "again", "prompts": [P], "max_tokens": 6, "reset_prefix_cache": "engine"},
    ]
    spec = engine_spec(tiny_model, kvpool_connector(sidecar.info["url"]), runs, enable_prefix_caching=True)
    engine = Engine(d, "engine", spec, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        engine.start()
        out = {r["label"]: engine.wait_done(r["label"], timeout=240) for r in runs}
        engine.finish()
        yield out
    finally:
        engine.kill()
        sidecar.stop()


def test_after_a_weight_update_and_a_connector_reset_no_old_kv_is_loaded(story) -> None:
    assert story["update"]["reset"] is True
    update, fresh = story["update"]["outputs"][0], story["fresh"]["outputs"][0]
    assert update["num_cached_tokens"] == 0  # neither vLLM's cache nor kvpool served old KV
    assert fresh["num_cached_tokens"] == 0
    assert update["token_ids"] == fresh["token_ids"]
    assert update["logprobs"] == fresh["logprobs"]  # the same step shapes: bit-identical
    assert update["token_ids"] != story["old"]["outputs"][0]["token_ids"]  # the weights did change


def test_what_is_saved_after_the_update_is_served(story) -> None:
    again, fresh = story["again"]["outputs"][0], story["fresh"]["outputs"][0]
    assert again["num_cached_tokens"] == 448
    assert again["token_ids"] == fresh["token_ids"]
