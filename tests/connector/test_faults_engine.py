"""Faults under the real vLLM CPU engine with prefix caching on (the production setting), real
sidecar processes and a real redis-server: a sidecar killed and restarted while a prompt is being
saved, reservations that expire under a slow writer, Redis evicting under memory pressure, Redis hung,
a sidecar that refuses chunks as large as the engine's.

Every case ends with outputs bit-identical to a clean cold run's, and with no wrong byte in any tier:
every chunk a faulty pod or Redis still holds equals the clean run's chunk under that key (the same
step shapes everywhere: prefill in steps of one chunk, one request at a time).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, kill_sidecar_mid_save, prompt_keys, stepped_engine
from kvtest import RedisServer, free_port, redis_call, start_sidecar, wait_until

from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.redis_format import chunk_key

pytestmark = pytest.mark.engine

PROMPTS = {name: random_prompt(600, 512, seed=50 + i) for i, name in enumerate("ABCDE")}
POD = ("--keep-arena",)  # as the operator runs the pod's sidecar: a restart reuses the arena file


def _engine(d: Path, name: str, model: Path, url: str, labels: dict[str, str]) -> Engine:
    """An engine whose runs (label: prompt name) each wait for the test's go."""
    return stepped_engine(d, name, model, url, {label: PROMPTS[p] for label, p in labels.items()})


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("faults")
    (d / "redis").mkdir()
    redis = RedisServer(free_port(), d / "redis").start()
    # Redis evicts whole keys, whichever: a chunk is one key, so it goes whole or not at all
    redis_call(redis.port, "CONFIG", "SET", "maxmemory-policy", "allkeys-random")
    clean = start_sidecar(d / "clean", "64Mi")  # the reference: a clean cold run of every prompt
    pod = start_sidecar(d / "pod", "64Mi", [redis.url], *POD)
    fresh = start_sidecar(d / "fresh", "64Mi", [redis.url])  # another pod: loads from Redis only
    s: dict[str, Any] = {"clean": SidecarClient(clean.info["url"], timeout=5)}
    small = None
    engines: list[Engine] = []
    try:
        ref = _engine(d, "ref", tiny_model, clean.info["url"], {p: p for p in PROMPTS})
        engines.append(ref.start())
        s["cold"] = {p: ref.step(p) for p in PROMPTS}
        ref.finish()

        a = _engine(d, "a", tiny_model, pod.info["url"], {"A": "A", "restart": "B", "slow": "C", "D": "D"})
        engines.append(a.start())
        a.wait_done("warmup")
        s["A"] = a.step("A")
        # the pod's sidecar is killed while B's chunks are being saved, and comes back at once
        port = pod.info["port"]
        restart = lambda: start_sidecar(d / "pod", "64Mi", [redis.url], *POD, port=port)  # noqa: E731
        pod = kill_sidecar_mid_save(a, "restart", pod, restart)
        s["restart"] = a.wait_done("restart")["outputs"][0]
        # every reservation expires before its commit: a writer slower than its lease (1 µs: less
        # than one loopback round trip, so no writer on any machine is fast enough; 1 ms was not)
        pod.stop()
        lease = ["--lease-seconds", "0.000001"]
        pod = start_sidecar(d / "pod", "64Mi", [redis.url], *POD, *lease, port=pod.info["port"])
        s["slow"] = a.step("slow")
        slow_pod = SidecarClient(pod.info["url"], timeout=5)
        s["slow_stats"] = slow_pod.stats()
        s["slow_chunks"] = {k: slow_pod.get(k) for k in prompt_keys(tiny_model, PROMPTS["C"])}
        pod.stop()
        pod = start_sidecar(d / "pod", "64Mi", [redis.url], *POD, port=pod.info["port"])
        s["D"] = a.step("D")
        flushed = lambda: SidecarClient(pod.info["url"]).stats()["tiers"]["redis"]["queued"] == 0  # noqa: E731
        wait_until(flushed, 60, "the write-behind of D")
        a.finish()
        s["pod"] = SidecarClient(pod.info["url"], timeout=5)

        b = _engine(d, "b", tiny_model, fresh.info["url"], {"A": "A", "evicted": "D", "hung": "E"})
        engines.append(b.start())
        b.wait_done("warmup")
        s["b_A"] = b.step("A")  # from Redis, promoted into this pod's arena
        # Redis runs out of memory and evicts half of what it holds
        used = _info(redis.port, "memory", "used_memory")
        redis_call(redis.port, "CONFIG", "SET", "maxmemory", str(used // 2))
        redis_call(redis.port, "SET", "kvpool-test-pressure", "x" * 4096)
        s["evicted_keys"] = _info(redis.port, "stats", "evicted_keys")
        middle = chunk_key(prompt_keys(tiny_model, PROMPTS["D"])[4])
        redis_call(redis.port, "DEL", middle)  # and D's fifth chunk, at least, is one of them
        s["evicted"] = b.step("evicted")
        assert redis.proc is not None
        redis.proc.popen.send_signal(signal.SIGSTOP)  # Redis hangs
        try:
            s["hung"] = b.step("hung")
            s["hung_redis"] = SidecarClient(fresh.info["url"], timeout=5).stats()["tiers"]["redis"]
        finally:
            redis.proc.popen.send_signal(signal.SIGCONT)
        b.finish()
        s["fresh"] = SidecarClient(fresh.info["url"], timeout=5)
        # a sidecar that takes smaller chunks than this engine's (as a 70B model's at TP 1 with a
        # small --max-chunk-bytes): saving is off from the start with one clear error, nothing else
        small = start_sidecar(d / "small", "64Mi", [], "--max-chunk-bytes", "65536")
        c = _engine(d, "c", tiny_model, small.info["url"], {"A": "A"})
        engines.append(c.start())
        s["oversized"] = c.step("A")
        c.finish()
        s["oversized_log"] = c.log.read_text(errors="replace")
        s["small"] = SidecarClient(small.info["url"], timeout=5).stats()
        s["logs"] = "".join(e.log.read_text(errors="replace") for e in engines)
        s["redis_reader"] = start_sidecar(d / "reader", "64Mi", [redis.url])  # reads Redis's copies
        yield s
    finally:
        for e in engines:
            e.kill()
        for proc in (clean, pod, fresh, small, s.get("redis_reader")):
            if proc is not None:
                proc.stop()
        redis.stop()


def _info(port: int, section: str, field: str) -> int:
    text = redis_call(port, "INFO", section)
    return int(text.split(field.encode() + b":")[1].split(b"\r")[0])


def _same(out: dict[str, Any], cold: dict[str, Any]) -> None:
    assert out["token_ids"] == cold["token_ids"]
    assert out["logprobs"] == cold["logprobs"]  # bit-identical floats


def test_a_sidecar_killed_mid_save_changes_no_output(story) -> None:
    _same(story["A"], story["cold"]["A"])
    _same(story["restart"], story["cold"]["B"])


def test_reservations_expiring_under_a_slow_writer_store_nothing(story) -> None:
    _same(story["slow"], story["cold"]["C"])
    assert story["slow_stats"]["refused_commits"] > 0  # writers slower than their 1 µs lease
    assert all(data is None for data in story["slow_chunks"].values())  # and nothing got in
    _same(story["D"], story["cold"]["D"])


def test_redis_evicting_and_hung_change_no_output(story) -> None:
    _same(story["b_A"], story["cold"]["A"])
    assert story["b_A"]["num_cached_tokens"] > 0  # loaded from Redis through another pod
    assert story["evicted_keys"] > 0
    _same(story["evicted"], story["cold"]["D"])
    _same(story["hung"], story["cold"]["E"])
    assert story["hung_redis"]["shards_up"] == 0  # the sidecar's lookup found Redis hung, within its budget
    # and answered the engine's lookup in time: none waited out the connector's timeout, which would
    # have stalled the engine's schedule() for it
    assert "lookup timed out" not in story["logs"]
    assert "Traceback" not in story["logs"]


def test_chunks_larger_than_the_sidecar_takes_turn_saving_off_once_and_change_no_output(story) -> None:
    _same(story["oversized"], story["cold"]["A"])
    assert story["oversized_log"].count("refuses this worker's chunks") == 1  # one worker, one line
    assert (story["small"]["chunks"], story["small"]["bytes_in"]) == (0, 0)


def test_no_wrong_byte_in_any_tier(story, tiny_model) -> None:
    clean: SidecarClient = story["clean"]
    reader = SidecarClient(story["redis_reader"].info["url"], timeout=10)
    checked = 0
    for p, tokens in PROMPTS.items():
        for key in prompt_keys(tiny_model, tokens):
            expected = clean.get(key)
            assert expected is not None, f"the clean run did not store {p}'s chunk {key}"
            for tier in (story["pod"], story["fresh"], reader):
                data = tier.get(key)
                if data is not None:
                    assert data == expected, f"{p}: chunk {key} differs from the clean run's"
                    checked += 1
    assert checked > 20
