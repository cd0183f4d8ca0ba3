"""Two pods in miniature: two engine processes, each with its own sidecar, the sidecars sharing one
real Redis. The second engine loads what the first saved, and its outputs match; a prefix the two
share to the middle of a chunk, and returning users whose first rounds the first engine served, load
to their last block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from enginekit import (
    BLOCK,
    CHUNK,
    Engine,
    engine_spec,
    kvpool_connector,
    prompt_keys,
    reference_runs,
    same_as_reference,
    tiny_namespace,
)
from kvtest import RedisServer, start_sidecar, wait_until

from kvpool_connector.keys import chunk_keys
from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

PROMPT = random_prompt(600, 512, seed=21)
WARMUP = {"label": "warmup", "prompts": [random_prompt(100, 512, seed=22)], "max_tokens": 2}
SHARED = random_prompt(8 * CHUNK + BLOCK, 512, seed=31)  # ends one block into a chunk
FIRST = SHARED + random_prompt(CHUNK - BLOCK + 24, 512, seed=32)
SECOND = SHARED + random_prompt(CHUNK - BLOCK + 24, 512, seed=33)
# three users' first rounds: 3 chunks and a block, 8 tokens under the next; their second rounds, 40 more
FIRST_ROUNDS = [random_prompt(3 * CHUNK + BLOCK + 8, 512, seed=40 + i) for i in range(3)]
SECOND_ROUNDS = [p + random_prompt(40, 512, seed=50 + i) for i, p in enumerate(FIRST_ROUNDS)]


@contextlib.contextmanager
def two_pods(
    tmp_path: Path,
    model: Path,
    redis: RedisServer,
    x_runs: list[dict[str, Any]],
    y_runs: list[dict[str, Any]],
) -> Iterator[tuple[Engine, Engine, SidecarClient]]:
    """Engines X and Y, each with its own sidecar, the sidecars sharing `redis` under one pool key (as
    the operator sets it: chunks in Redis carry the pool's MAC). Each runs a warm-up first; Y's first
    run after it waits for y.go(its label). Yields X, Y and a client of Y's sidecar."""
    pool = {"KVPOOL_POOL_KEY": "one-pool"}
    a = start_sidecar(tmp_path, "64Mi", [redis.url], "--pool-key-required", env=pool)
    b = start_sidecar(tmp_path, "64Mi", [redis.url], "--pool-key-required", env=pool)
    x = Engine(tmp_path, "x", engine_spec(model, kvpool_connector(a.info["url"]), [WARMUP, *x_runs]))
    y = Engine(tmp_path, "y", {})
    held, *rest = y_runs
    held = {**held, "wait_for": y.go_file(held["label"])}
    y.spec = engine_spec(model, kvpool_connector(b.info["url"]), [WARMUP, held, *rest])
    try:
        x.start()
        y.start()
        yield x, y, SidecarClient(b.info["url"], timeout=5)
        x.finish()
        y.finish()
    finally:
        x.kill()
        y.kill()
        a.stop()
        b.stop()


def test_second_engine_loads_what_the_first_saved_through_redis(
    tmp_path: Path, tiny_model: Path, redis: RedisServer
) -> None:
    cold_run = {"label": "cold", "prompts": [PROMPT], "max_tokens": 6}
    warm_run = {"label": "warm", "prompts": [PROMPT], "max_tokens": 6}
    with two_pods(tmp_path, tiny_model, redis, [cold_run], [warm_run]) as (x, y, b_client):
        cold = x.wait_done("cold")
        keys = prompt_keys(tiny_model, PROMPT)
        assert b_client.stats()["chunks"] <= 2  # B holds only its own warm-up's chunks
        # A writes behind to Redis; B sees the chunks once they are there
        wait_until(lambda: b_client.lookup(keys) == len(keys), 60, "the chunks to reach Redis")
        y.go("warm")
        warm = y.wait_done("warm")
        promotions = b_client.stats()["promotions"]
    assert promotions >= len(keys)  # B loaded them from Redis, not from its own saves
    assert warm["outputs"][0]["num_cached_tokens"] == 576
    assert warm["outputs"][0]["token_ids"] == cold["outputs"][0]["token_ids"]
    assert warm["outputs"][0]["logprobs"] == cold["outputs"][0]["logprobs"]


def test_prefixes_the_other_engine_saved_load_to_their_last_block(
    tmp_path: Path, tiny_model: Path, redis: RedisServer
) -> None:
    """Prefix repetition across pods (#24 item 3), on one pair of engines:
    - Engine X's prompt and engine Y's share 8 chunks and a block. Y finds the whole chunks in Redis,
      and the block through the key of the block prefix of X's ninth chunk, which X's sidecar wrote
      behind as an alias: Y loads all 544 shared tokens, as from its own CPU tier, with the
      reference's tokens. Before, Redis knew chunks only: 512.
    - Three users' second rounds reach Y at once; X served their first rounds. Y has seen none of their
      chunks stored, so each lookup guesses a miss at chunk 0 and asks that chunk's tails, but their
      prefixes run on to the first rounds' tails, a block into chunk 3. The first asks for its tail in
      a second round trip; the others' lookups whose answers have come go again with chunk 3's tails
      meanwhile. Each loads its first round's 224 tokens, with the reference's tokens."""
    x_runs = [{"label": "first", "prompts": [FIRST]}, {"label": "rounds", "prompts": FIRST_ROUNDS}]
    users = {"prompts": SECOND_ROUNDS, "max_tokens": 6}
    y_runs = [
        *reference_runs([("second", SECOND)]),
        {"label": "users", **users, "reset_prefix_cache": "engine"},
        {"label": "users-ref", **users, "cache_salt": "users"},
    ]
    with two_pods(tmp_path, tiny_model, redis, x_runs, y_runs) as (x, y, b_client):
        x.wait_done("rounds")
        ns = tiny_namespace(tiny_model)
        shared = chunk_keys(ns, SHARED, 0)  # the last: the 9th chunk's first block
        wait_until(lambda: b_client.lookup(shared[:8]) == 8, 60, "the whole chunks in Redis")
        wait_until(lambda: b_client.first_whole([shared[8:]]) == 0, 60, "the block prefix's alias in Redis")
        rounds = [chunk_keys(ns, p[: 3 * CHUNK + BLOCK], 0) for p in FIRST_ROUNDS]  # 3 chunks, the tail
        wait_until(lambda: all(b_client.lookup(k) == 4 for k in rounds), 60, "the first rounds in Redis")
        y.go("second")
        out = {
            label: y.wait_done(label)["outputs"] for label in ("second", "second-ref", "users", "users-ref")
        }
    assert out["second"][0]["num_cached_tokens"] == len(SHARED)
    same_as_reference({label: o[0] for label, o in out.items()}, "second")
    assert [o["num_cached_tokens"] for o in out["users"]] == [3 * CHUNK + BLOCK] * 3
    for got, ref in zip(out["users"], out["users-ref"], strict=True):
        same_as_reference({"user": got, "user-ref": ref}, "user")
