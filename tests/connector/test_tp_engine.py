"""Tensor parallel 2 on the real vLLM CPU engine (a worker process per rank, each bound to its own
core), prefix caching on, one real sidecar process: each rank saves its own copy of every chunk, and a
load that fails on one rank only (its copy corrupted behind the sidecar's back, after the lookup found
every rank's) changes no output and leaves no wrong byte in the sidecar. Rank 0 loads that chunk
fine; were it to commit chunks computed over rank 1's never-loaded blocks (attention output is
all-reduced across the ranks), its copies would differ from the clean run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, engine_spec, kvpool_connector, prompt_keys
from kvtest import start_sidecar

from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

TP = 2
PROMPT = random_prompt(600, 512, seed=70)  # 9 full chunks of 64 tokens and a tail
WARMUP = {"label": "warmup", "prompts": [random_prompt(100, 512, seed=79)], "max_tokens": 2}
BAD_CHUNK = 3


def _run_tp2(d: Path, name: str, model: Path, url: str) -> dict[str, Any]:
    engine = Engine(d, name, {}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    connector = kvpool_connector(url, timeout_ms=5000)
    runs = [WARMUP, {"label": "p", "prompts": [PROMPT], "max_tokens": 6}]
    engine.spec = engine_spec(model, connector, runs, enable_prefix_caching=True, tensor_parallel_size=TP)
    engine.start()
    try:
        out = engine.wait_done("p")["outputs"][0]
        engine.finish()
        return out
    finally:
        engine.kill()


def test_a_load_failing_on_one_rank_changes_no_output_and_stores_no_wrong_byte(tmp_path, tiny_model) -> None:
    sidecar = start_sidecar(tmp_path / "sidecar", "64Mi")
    client = SidecarClient(sidecar.info["url"], timeout=5)
    try:
        cold = _run_tp2(tmp_path, "cold", tiny_model, sidecar.info["url"])
        keys = {rank: prompt_keys(tiny_model, PROMPT, TP, rank) for rank in range(TP)}
        clean = {k: client.get(k) for rank_keys in keys.values() for k in rank_keys}
        assert None not in clean.values()  # every rank saved its own copy of every full chunk
        assert clean[keys[0][0]] != clean[keys[1][0]]  # of its own KV heads
        bad = keys[1][BAD_CHUNK]
        pinned = client.pin([bad])
        client.arena()[pinned.slots[0].offset + 100] ^= 0x01  # behind the sidecar's back
        client.release(pinned.lease)
        served = client.stats()["bytes_out"]

        warm = _run_tp2(tmp_path, "warm", tiny_model, sidecar.info["url"])
        assert warm["token_ids"] == cold["token_ids"]
        assert warm["logprobs"] == cold["logprobs"]  # bit-identical floats
        stats = client.stats()
        assert stats["bytes_out"] > served  # the warm engine did load from the sidecar
        assert stats["corrupt_dropped"] == 1  # rank 1's check caught its copy; the sidecar dropped it
        # every copy of every rank as the clean run saved it (rank 1's bad one recomputed and saved again)
        assert {k: client.get(k) for k in clean} == clean
    finally:
        sidecar.stop()
