"""Tenants and model versions on the real vLLM CPU engine, with vLLM's prefix caching on (the
production default), through the connector and a real sidecar process.

- The same tokens under two cache salts, or with and without a LoRA adapter, never load each other's
  chunks (nor vLLM's own cache's), and each still hits its own chunks from a fresh engine process.
- New weights at the same model path (a rolling upgrade) load nothing the old weights saved, and the
  new model's outputs equal its own cold outputs bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from enginekit import SAVES_IN_STEP, Engine, engine_spec, kvpool_connector
from kvtest import start_sidecar

from kvpool_demo.tinymodel import TINY, make_lora, make_model, random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

PROMPT = random_prompt(600, 512, seed=31)
WARM_TOKENS = 576  # the last token is recomputed; loads stop at its block
WARMUP = {"label": "warmup", "prompts": [random_prompt(100, 512, seed=32)], "max_tokens": 2}


def _engine(d: Path, name: str, model: Path, url: str | None, runs: dict[str, dict[str, Any]]) -> Engine:
    """An engine (LoRA enabled) whose runs (label: cache_salt or lora) each wait for the test's go,
    after a warm-up."""
    engine = Engine(d, name, {})
    # saves inside the step: the sidecar's chunk count read after a run is then all that run saved (off
    # the step, on a loaded machine, the last of them could still be on their way)
    connector = kvpool_connector(url, **SAVES_IN_STEP) if url else None
    steps = [
        {"label": label, "prompts": [PROMPT], "max_tokens": 6, "wait_for": engine.go_file(label), **inputs}
        for label, inputs in runs.items()
    ]
    engine.spec = engine_spec(model, connector, [WARMUP, *steps], enable_prefix_caching=True, max_lora_rank=8)
    return engine


def _out(run: dict[str, Any]) -> dict[str, Any]:
    return run["outputs"][0]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("tenants")
    model = d / "model"  # its own copy: its weights are replaced below
    shutil.copytree(tiny_model, model)
    sidecar = start_sidecar(d, "64Mi")
    url = sidecar.info["url"]
    client = SidecarClient(url, timeout=5)
    s: dict[str, Any] = {}
    engines: list[Engine] = []

    def run_all(engine: Engine) -> None:
        engines.append(engine.start())
        engine.wait_done("warmup")  # its own chunk saved before anything is counted
        for run in engine.spec["runs"][1:]:
            label = run["label"]
            s[f"chunks_before_{label}"] = client.stats()["chunks"]
            engine.go(label)
            s[label] = engine.wait_done(label)
            s[f"chunks_after_{label}"] = client.stats()["chunks"]
        engine.finish()

    lora = {"lora": {"name": "tuned", "id": 1, "path": str(make_lora(d / "adapter", model))}}
    a, b = {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}
    try:
        run_all(
            _engine(d, "first", model, url, {"a_cold": a, "b_cold": b, "plain_cold": {}, "lora_cold": lora})
        )
        run_all(_engine(d, "fresh", model, url, {"a_warm": a, "b_warm": b, "lora_warm": lora}))
        make_model(model, TINY, seed=1)  # new weights, same path, same config
        run_all(_engine(d, "upgraded", model, url, {"upgraded": {}}))
        run_all(_engine(d, "upgraded_cold", model, None, {"upgraded_cold": {}}))
    finally:
        for engine in engines:
            engine.kill()
        sidecar.stop()
    return s


def test_salts_and_adapters_never_share_and_each_hits_its_own_from_a_fresh_engine(
    story: dict[str, Any],
) -> None:
    for label in ("a_cold", "b_cold", "plain_cold", "lora_cold"):  # neither vLLM's cache nor kvpool gave any
        assert _out(story[label])["num_cached_tokens"] == 0, label
        # each saved its own nine chunks (tenant A's were there already when the others ran)
        assert story[f"chunks_after_{label}"] - story[f"chunks_before_{label}"] == 9, label
    assert _out(story["lora_cold"])["logprobs"] != _out(story["plain_cold"])["logprobs"]  # the adapter acts
    for warm, cold in (("a_warm", "a_cold"), ("b_warm", "b_cold"), ("lora_warm", "lora_cold")):
        assert _out(story[warm])["num_cached_tokens"] == WARM_TOKENS, warm
        assert _out(story[warm])["token_ids"] == _out(story[cold])["token_ids"]
        assert _out(story[warm])["logprobs"] == _out(story[cold])["logprobs"]


def test_new_weights_at_the_same_path_load_nothing_and_match_their_own_cold_run(
    story: dict[str, Any],
) -> None:
    assert _out(story["upgraded"])["num_cached_tokens"] == 0
    assert story["chunks_after_upgraded"] - story["chunks_before_upgraded"] == 9  # saved under new keys
    assert _out(story["upgraded"])["token_ids"] == _out(story["upgraded_cold"])["token_ids"]
    assert _out(story["upgraded"])["logprobs"] == _out(story["upgraded_cold"])["logprobs"]
    assert _out(story["upgraded"])["logprobs"] != _out(story["a_cold"])["logprobs"]  # other weights indeed
