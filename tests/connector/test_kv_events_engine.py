"""Routers see kvpool's tier: vLLM's own KV events publisher (ZMQ) carries the connector's BlockStored
and BlockRemoved events (medium CPU, as vLLM's OffloadingConnector names its CPU tier), with vLLM's
block hashes, read here as a router reads them (vLLM's examples/online_serving/kv_events_subscriber.py).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from enginekit import CHUNK, Engine, engine_spec, kvpool_connector, prompt_keys
from kvtest import free_port, start_sidecar, wait_until
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

P = random_prompt(600, 512, seed=11)  # 9 chunks of 64 tokens (18 blocks of 32) saved; 24 tokens beyond
CHUNKS = 9
GONE = 4  # the chunk deleted from the sidecar behind the engine's back


class Subscriber:
    """A router's end: binds on loopback, vLLM's publisher connects; every batch, in order."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.events: list[Any] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.bind(self.endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if self._sub.poll(100):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.events += decoder.decode(payload).events

    def of(self, kind: type, medium: str) -> list[Any]:
        return [e for e in list(self.events) if isinstance(e, kind) and getattr(e, "medium", None) == medium]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("kv-events")
    sidecar = start_sidecar(d, "64Mi")
    client = SidecarClient(sidecar.info["url"], timeout=5)
    sub = Subscriber()
    e = Engine(d, "e1", {})
    go = e.go_file
    e.spec = engine_spec(
        tiny_model,
        kvpool_connector(sidecar.info["url"]),
        [
            {"label": "cold", "prompts": [P], "max_tokens": 2},
            # vLLM's own cache emptied: the prompt comes back from kvpool, but for the chunk deleted
            {
                "label": "again",
                "prompts": [P],
                "max_tokens": 2,
                "reset_prefix_cache": "engine",
                "wait_for": go("again"),
            },
            # a new key generation: nothing announced is found again; the chunk it saves is new
            {
                "label": "reset",
                "prompts": [P[:CHUNK]],
                "max_tokens": 1,
                "reset_prefix_cache": "connector",
                "wait_for": go("reset"),
            },
        ],
        enable_prefix_caching=True,  # vLLM's block hashes: what routers key on
        kv_events_endpoint=sub.endpoint,
    )
    s: dict[str, Any] = {}
    try:
        e.start()
        e.wait_done("cold")
        # vLLM's own events arrive (the subscriber works), then kvpool's
        wait_until(lambda: len(_blocks(sub.of(BlockStored, "GPU"))) >= 18, 30, "vLLM's own BlockStored")
        s["cold_stored"] = wait_until(
            lambda: len(sub.of(BlockStored, "CPU")) >= CHUNKS and sub.of(BlockStored, "CPU"),
            30,
            "kvpool's BlockStored",
        )
        s["gpu_stored"] = sub.of(BlockStored, "GPU")
        assert client.delete(prompt_keys(tiny_model, P)[GONE])
        e.go("again")
        e.wait_done("again")
        s["again_stored"] = wait_until(
            lambda: len(sub.of(BlockStored, "CPU")) > CHUNKS and sub.of(BlockStored, "CPU"),
            30,
            "the chunk saved again",
        )
        e.go("reset")
        e.wait_done("reset")
        e.finish()
        wait_until(
            lambda: len(sub.of(BlockRemoved, "CPU")) >= 2 and len(sub.of(BlockStored, "CPU")) >= CHUNKS + 2,
            30,
            "kvpool's BlockRemoved",
        )
        s["stored"], s["removed"] = sub.of(BlockStored, "CPU"), sub.of(BlockRemoved, "CPU")
        return s
    finally:
        e.kill()
        sub.close()
        client.close()
        sidecar.stop()


def _blocks(events: list[Any]) -> list[Any]:
    return [h for ev in events for h in ev.block_hashes]


def test_saved_chunks_are_announced_with_vllms_block_hashes(seen: dict[str, Any]) -> None:
    stored = seen["cold_stored"][:CHUNKS]
    gpu = _blocks(seen["gpu_stored"])  # vLLM's own announcement of the prompt's 18 full blocks
    assert _blocks(stored) == gpu[: CHUNKS * CHUNK // 32]
    assert [t for ev in stored for t in ev.token_ids] == P[: CHUNKS * CHUNK]
    assert stored[0].parent_block_hash is None
    assert all(ev.parent_block_hash == prev.block_hashes[-1] for prev, ev in itertools.pairwise(stored))
    assert {(ev.block_size, ev.group_idx, ev.lora_id) for ev in stored} == {(32, 0, None)}


def test_a_chunk_found_gone_is_withdrawn_and_saved_again(seen: dict[str, Any]) -> None:
    chunk = seen["cold_stored"][GONE]
    assert seen["removed"][0].block_hashes == chunk.block_hashes  # the lookup that missed it
    # announced once while held: the hits of "again" and its chunks saved already add nothing; the
    # recomputed chunk that was gone comes back
    again = seen["again_stored"][CHUNKS:]
    assert [ev.block_hashes for ev in again] == [chunk.block_hashes]


def test_a_connector_reset_withdraws_everything_announced(seen: dict[str, Any]) -> None:
    withdrawn = _blocks(seen["removed"][1:])
    assert sorted(withdrawn) == sorted(_blocks(seen["cold_stored"][:CHUNKS]))
    # what the engine saves after the reset is announced anew (under the same vLLM hashes)
    (first,) = seen["stored"][CHUNKS + 1 :]
    assert first.block_hashes == seen["cold_stored"][0].block_hashes
