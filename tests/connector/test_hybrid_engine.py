"""A hybrid model (Gemma 2-style: windowed and full-attention layers alternate, window 64 tokens) on the
real vLLM CPU engine with prefix caching on and kvpool's CPU tier, vLLM's hybrid KV cache manager on:
two KV cache groups, the windowed one holding only its window's blocks.

kvpool declares SupportsHMA, so vLLM keeps the hybrid manager (it used to turn it off for kvpool: a
model then had the KV capacity of all-full attention). Each group's part of a chunk is stored under
its own key; a hit is the full-attention group's chunks from the prompt's start and the windowed
group's chunks inside the window before the hit's end (vLLM gives the null block for the rest).

- A multi-round conversation with long prefill steps: every round loads its earlier rounds from
  kvpool (vLLM's own cache reset between them) and gives the tokens of a run no cache can serve.
- A chunk whose bytes changed in the arena: the load fails its checksum; vLLM takes no block ids
  from a connector on a hybrid model (they are per group), so kvpool reports the request as failed
  and vLLM recomputes it whole (it used to report blocks: vLLM raised and the engine died).
- One-block prefill steps: the windowed group's blocks leave the window before the step that
  completes a chunk, so that group's part is not saved while the full group's is; a prompt that
  shares only those blocks finds no hit (a hit needs both groups), one that shares a chunk whose
  both parts were saved does.

The reference for every prompt is the same prompt with a cache salt of its own, in the same engine:
neither vLLM's prefix cache nor kvpool can serve it. Its step shapes differ from a hit's, so
logprobs are compared within float noise; tokens exactly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from enginekit import (
    LONG_STEPS,
    SAVES_IN_STEP,
    Engine,
    conversation_runs,
    engine_spec,
    flip_a_byte_in_every_page,
    kvpool_connector,
    reference_runs,
    same_as_reference,
    serve_with_kvpool,
)
from kvtest import start_sidecar

from kvpool_demo.tinymodel import TINY_CHUNKED, TINY_HYBRID, make_model, random_prompt
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.wire import ARENA_FILE

pytestmark = pytest.mark.engine

A = random_prompt(300, 512, seed=21)
ROUND2 = A + random_prompt(100, 512, seed=22)
ROUND3 = ROUND2 + random_prompt(120, 512, seed=23)
SHARED = random_prompt(200, 512, seed=24)
C = SHARED[:64] + random_prompt(36, 512, seed=25)  # shares one chunk's first two blocks
B = SHARED[:100]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-hybrid", TINY_HYBRID)


@pytest.fixture(scope="module")
def long_steps(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path) -> dict[str, Any]:
    runs = conversation_runs(A, ROUND2, ROUND3)
    return serve_with_kvpool(tmp_path_factory.mktemp("hybrid-long"), hybrid_model, runs, **LONG_STEPS)


@pytest.fixture(scope="module")
def chunked_long_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = make_model(tmp_path_factory.mktemp("model") / "tiny-llama4", TINY_CHUNKED)
    runs = conversation_runs(A, ROUND2, ROUND3)
    return serve_with_kvpool(tmp_path_factory.mktemp("chunked-long"), model, runs, **LONG_STEPS)


@pytest.fixture(scope="module")
def chunked_one_block_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = make_model(tmp_path_factory.mktemp("model") / "tiny-llama4", TINY_CHUNKED)
    runs = [{"label": "shared", "prompts": [SHARED], "max_tokens": 6}, *reference_runs([("C", C), ("B", B)])]
    return serve_with_kvpool(
        tmp_path_factory.mktemp("chunked-steps"),
        model,
        runs,
        max_num_batched_tokens=32,
        max_model_len=256,
        kv_cache_bytes=32 * 32768,  # 32 blocks of one layer: a freed block is handed out again soon
        enable_prefix_caching=True,
        connector_extra=SAVES_IN_STEP,
    )


@pytest.fixture(scope="module")
def one_block_steps(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path) -> dict[str, Any]:
    runs = [{"label": "shared", "prompts": [SHARED], "max_tokens": 6}, *reference_runs([("C", C), ("B", B)])]
    return serve_with_kvpool(
        tmp_path_factory.mktemp("hybrid-steps"),
        hybrid_model,
        runs,
        max_num_batched_tokens=32,
        max_model_len=256,
        kv_cache_bytes=16 * 65536,  # 16 blocks of 2 layers (each shared by a windowed and a full layer)
        enable_prefix_caching=True,
        connector_extra=SAVES_IN_STEP,
    )


@pytest.fixture(scope="module")
def corrupt_chunks(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("hybrid-corrupt")
    sidecar = start_sidecar(d, "64Mi")
    client = SidecarClient(sidecar.info["url"], timeout=5)
    engine = Engine(d, "engine", {})
    labels = ["cold", "corrupt", "again"]
    runs = [
        {
            "label": label,
            "prompts": [A],
            "max_tokens": 6,
            "wait_for": engine.go_file(label),
            "reset_prefix_cache": "engine",
        }
        for label in labels
    ]
    runs.append({"label": "corrupt-ref", "prompts": [A], "max_tokens": 6, "cache_salt": "ref"})
    connector = kvpool_connector(sidecar.info["url"], chunk_size=128)
    engine.spec = engine_spec(
        hybrid_model, connector, runs, max_num_batched_tokens=512, enable_prefix_caching=True
    )
    out: dict[str, Any] = {}
    try:
        engine.start()
        engine.go("cold")
        out["cold"] = engine.wait_done("cold", timeout=240)["outputs"][0]
        # a rogue writer: one byte changed in every 4 KiB page of the arena but its header's, so every
        # stored chunk fails its checksum while the sidecar still serves it
        flip_a_byte_in_every_page(sidecar.info["arena_dir"] / ARENA_FILE, header=False)
        for label in ("corrupt", "again"):
            engine.go(label)
            # a loop or a dead engine never gets here: a deadline well past what a run takes
            out[label] = engine.wait_done(label, timeout=240)["outputs"][0]
        out["corrupt-ref"] = engine.wait_done("corrupt-ref", timeout=240)["outputs"][0]
        engine.finish()
        out["stats"] = client.stats()
        out["log"] = engine.log.read_text(errors="replace")
        return out
    finally:
        engine.kill()
        client.close()
        sidecar.stop()


def _hybrid_manager_on(log: str) -> None:
    assert "Turning off hybrid kv cache manager" not in log
    # vLLM's KV cache config: one group per attention kind, both of the same block size
    assert re.search(r"kv cache group sizes \(\d+, \d+\)", log), "not two KV cache groups"


def test_a_multi_round_conversation_loads_each_round_with_the_hybrid_manager_on(long_steps) -> None:
    _hybrid_manager_on(long_steps["log"])
    for label in ("again", "round2", "round3"):
        same_as_reference(long_steps, label)
    # each round loaded from kvpool what earlier rounds saved (vLLM's own cache was reset): the full
    # group's whole 128-token chunks and the windowed group's last ones, a partial tail block by block
    assert long_steps["again"]["num_cached_tokens"] == 288  # A's two chunks and a block of its tail
    assert long_steps["round2"]["num_cached_tokens"] == 288  # the same: A is all it shares
    assert long_steps["round3"]["num_cached_tokens"] == 384  # round 2's three chunks
    assert "Recovered from KV load failure" not in long_steps["log"]


def test_a_hit_needs_both_groups_and_no_part_is_saved_from_blocks_the_window_let_go(one_block_steps) -> None:
    _hybrid_manager_on(one_block_steps["log"])
    same_as_reference(one_block_steps, "C")
    same_as_reference(one_block_steps, "B")
    # SHARED's first chunk: its windowed part lost its first block to the window before the step that
    # completed it, so only the full group's part was saved; C, which shares its first two blocks,
    # finds no hit
    assert one_block_steps["C"]["num_cached_tokens"] == 0
    # C's own 96-token tail completed while all its blocks were in the window: both parts saved, and B
    # loads the two blocks it shares with it
    assert one_block_steps["B"]["num_cached_tokens"] == 64
    assert "Recovered from KV load failure" not in one_block_steps["log"]


def test_a_chunk_that_fails_its_checksum_is_recomputed_whole_and_saved_again(corrupt_chunks) -> None:
    _hybrid_manager_on(corrupt_chunks["log"])
    same_as_reference(corrupt_chunks, "corrupt")
    assert corrupt_chunks["stats"]["corrupt_dropped"] >= 1  # the worker had the sidecar drop it
    assert "Traceback" not in corrupt_chunks["log"]
    # recomputed and saved again: the next run loads it
    assert corrupt_chunks["again"]["num_cached_tokens"] == 288
    assert corrupt_chunks["again"]["token_ids"] == corrupt_chunks["cold"]["token_ids"]


def test_chunked_local_attention_loads_each_round_with_the_hybrid_manager_on(chunked_long_steps) -> None:
    """Llama 4-style: three of four layers attend within their own 64-token attention chunk (vLLM
    keeps only the current attention chunk's blocks for them), the fourth to all tokens."""
    log = chunked_long_steps["log"]
    assert "Turning off hybrid kv cache manager" not in log
    for label in ("again", "round2", "round3"):
        same_as_reference(chunked_long_steps, label)
    # the full layer's chunks from the start; the chunked layers' only where they reach past the start
    # of the attention chunk the hit ends in (vLLM gives the null block before it)
    assert chunked_long_steps["again"]["num_cached_tokens"] == 288  # A's two chunks and its tail block
    assert chunked_long_steps["round2"]["num_cached_tokens"] == 288
    assert chunked_long_steps["round3"]["num_cached_tokens"] == 384
    assert "Recovered from KV load failure" not in log


def test_chunked_local_layers_need_no_block_before_the_attention_chunk_a_hit_ends_in(
    chunked_one_block_steps,
) -> None:
    """One-block prefill steps: SHARED's first chunk completes after its first attention chunk has
    left the chunked layers, so only the full layer's part of it is saved (a part is saved whole or
    not at all). A hit ending at 64 needs the full layer's blocks only (the chunked layers' attention
    chunk starts there), found as that chunk's block prefix: C (which shares 64 tokens) and B (which
    shares 100, but whose longer hit would need the chunked part that was not saved) load 64."""
    out = chunked_one_block_steps
    same_as_reference(out, "C")
    same_as_reference(out, "B")
    assert out["C"]["num_cached_tokens"] == 64
    assert out["B"]["num_cached_tokens"] == 64
    assert "Recovered from KV load failure" not in out["log"]
