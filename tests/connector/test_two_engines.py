"""Two pods in miniature: two engine processes, each with its own sidecar, the sidecars sharing one
real Redis. The second engine loads what the first saved, and its outputs match."""

from __future__ import annotations

from pathlib import Path

import pytest
from enginekit import Engine, engine_spec, kvpool_connector, prompt_keys
from kvtest import RedisServer, start_sidecar, wait_until

from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

PROMPT = random_prompt(600, 512, seed=21)


def test_second_engine_loads_what_the_first_saved_through_redis(
    tmp_path: Path, tiny_model: Path, redis: RedisServer
) -> None:
    pool = {"KVPOOL_POOL_KEY": "one-pool"}  # as the operator sets it: chunks in Redis carry the pool's MAC
    a = start_sidecar(tmp_path, "64Mi", [redis.url], "--pool-key-required", env=pool)
    b = start_sidecar(tmp_path, "64Mi", [redis.url], "--pool-key-required", env=pool)
    warmup = {"label": "warmup", "prompts": [random_prompt(100, 512, seed=22)], "max_tokens": 2}
    x = Engine(
        tmp_path,
        "x",
        engine_spec(
            tiny_model,
            kvpool_connector(a.info["url"]),
            [warmup, {"label": "cold", "prompts": [PROMPT], "max_tokens": 6}],
        ),
    )
    y = Engine(tmp_path, "y", {})
    y.spec = engine_spec(
        tiny_model,
        kvpool_connector(b.info["url"]),
        [warmup, {"label": "warm", "prompts": [PROMPT], "max_tokens": 6, "wait_for": y.go_file("warm")}],
    )
    try:
        x.start()
        y.start()
        cold = x.wait_done("cold")
        keys = prompt_keys(tiny_model, PROMPT)
        b_client = SidecarClient(b.info["url"], timeout=5)
        assert b_client.stats()["chunks"] <= 2  # B holds only its own warm-up's chunks
        # A writes behind to Redis; B sees the chunks once they are there
        wait_until(lambda: b_client.lookup(keys) == len(keys), 60, "the chunks to reach Redis")
        y.go("warm")
        warm = y.wait_done("warm")
        promotions = b_client.stats()["promotions"]
        x.finish()
        y.finish()
    finally:
        x.kill()
        y.kill()
        a.stop()
        b.stop()
    assert promotions >= len(keys)  # B loaded them from Redis, not from its own saves
    assert warm["outputs"][0]["num_cached_tokens"] == 576
    assert warm["outputs"][0]["token_ids"] == cold["outputs"][0]["token_ids"]
    assert warm["outputs"][0]["logprobs"] == cold["outputs"][0]["logprobs"]
