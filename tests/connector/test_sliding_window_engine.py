"""A model whose every layer attends through a sliding window (Mistral-style, window 64 tokens), on the
real vLLM CPU engine with prefix caching on and kvpool's CPU tier: vLLM frees the blocks that leave
the window while a prompt is still being prefilled (they become its null block, and go to other
requests), and gives the null block for the out-of-window part of a hit.

- Long prefill steps, a multi-round conversation: each round's hit is longer than the window plus a
  block, so vLLM hands the null block for most of it. kvpool loads only the live blocks: every
  round completes with the tokens of a run no cache could serve (it used to load into the null
  block, fail its checksum and be offered the same hit forever).
- One-block prefill steps in a KV cache of 8 blocks: a chunk's first blocks leave the window (and
  are handed out again) before the step that completes the chunk. kvpool saves only chunks whose
  blocks are all still in the window, so prompts sharing a prefix load nothing wrong (it used to
  save the reused blocks' bytes under the chunk's key, and later loads gave wrong tokens).

The reference for every prompt is the same prompt with a cache salt of its own, in the same engine:
neither vLLM's prefix cache nor kvpool can serve it. Its step shapes differ from a hit's, so
logprobs are compared within float noise; tokens exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginekit import (
    LONG_STEPS,
    SAVES_IN_STEP,
    conversation_runs,
    reference_runs,
    same_as_reference,
    serve_with_kvpool,
)

from kvpool_demo.tinymodel import TINY_SWA, make_model, random_prompt

pytestmark = pytest.mark.engine

A = random_prompt(300, 512, seed=11)
ROUND2 = A + random_prompt(100, 512, seed=12)
ROUND3 = ROUND2 + random_prompt(120, 512, seed=13)
SHARED = random_prompt(200, 512, seed=14)
C = SHARED[:64] + random_prompt(36, 512, seed=15)  # shares one chunk's first two blocks
B = SHARED[:100]


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-mistral-swa", TINY_SWA)


@pytest.fixture(scope="module")
def long_steps(tmp_path_factory: pytest.TempPathFactory, swa_model: Path) -> dict[str, Any]:
    runs = conversation_runs(A, ROUND2, ROUND3)
    return serve_with_kvpool(tmp_path_factory.mktemp("swa-long"), swa_model, runs, **LONG_STEPS)


@pytest.fixture(scope="module")
def one_block_steps(tmp_path_factory: pytest.TempPathFactory, swa_model: Path) -> dict[str, Any]:
    runs = [{"label": "shared", "prompts": [SHARED], "max_tokens": 6}, *reference_runs([("C", C), ("B", B)])]
    return serve_with_kvpool(
        tmp_path_factory.mktemp("swa-steps"),
        swa_model,
        runs,
        max_num_batched_tokens=32,
        max_model_len=512,
        kv_cache_bytes=8 * 65536,  # 8 blocks: a freed block is handed out again at once
        enable_prefix_caching=True,
        connector_extra=SAVES_IN_STEP,
    )


def test_hits_longer_than_the_window_load_only_its_live_blocks_and_complete(long_steps) -> None:
    for label in ("again", "round2", "round3"):
        same_as_reference(long_steps, label)
    # each round loaded from kvpool what earlier rounds saved (vLLM's own cache was reset): their
    # whole 128-token chunks, and a saved partial tail block by block
    assert long_steps["again"]["num_cached_tokens"] == 288  # A's two chunks and a block of its tail
    assert long_steps["round2"]["num_cached_tokens"] == 288  # the same: A is all it shares
    assert long_steps["round3"]["num_cached_tokens"] == 384  # round 2's three chunks
    assert "Recovered from KV load failure" not in long_steps["log"]


def test_no_chunk_is_saved_from_blocks_the_window_let_go(one_block_steps) -> None:
    same_as_reference(one_block_steps, "C")
    same_as_reference(one_block_steps, "B")
    # SHARED's first chunk lost its first block to the window before the step that completed it: not
    # saved, so C (which shares its first two blocks) finds nothing
    assert one_block_steps["C"]["num_cached_tokens"] == 0
    # C's own 96-token tail completed while all its blocks were in the window: saved, and B loads the
    # two blocks it shares with it
    assert one_block_steps["B"]["num_cached_tokens"] == 64
