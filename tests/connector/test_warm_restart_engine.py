"""The cache stays warm across restarts, under the real vLLM CPU engine with prefix caching on:

- the pod's sidecar killed with SIGKILL while a prompt's chunks are being saved, and started again
  on the same arena (as the kubelet restarts a container in its pod): the engine's next returning
  prompts load as much from kvpool as before the kill;
- vLLM itself restarted (a new engine process, the same weights, other flags: max_model_len and KV
  size): its first returning prompt hits.

What vLLM's own prefix cache holds is reset before each returning prompt, so every cached token
counted is one kvpool served; every output equals the cold run's, bit for bit (the same step shapes:
prefill in steps of one chunk, one request at a time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, kill_sidecar_mid_save, stepped_engine
from kvtest import start_sidecar

from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

PROMPTS = {name: random_prompt(600, 512, seed=70 + i) for i, name in enumerate("ABCDE")}
POD = ("--keep-arena",)  # as the operator runs the pod's sidecar


def _engine(
    d: Path, name: str, model: Path, url: str, runs: list[tuple[str, str, bool]], **engine: Any
) -> Engine:
    """An engine whose runs (label, prompt name, returning) each wait for the test's go."""
    prompts = {label: PROMPTS[p] for label, p, _ in runs}
    returning = {label for label, _, r in runs if r}
    return stepped_engine(d, name, model, url, prompts, returning, **engine)


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("warm")
    pod = start_sidecar(d / "pod", "64Mi", [], *POD)
    s: dict[str, Any] = {}
    engines: list[Engine] = []
    try:
        cold = [(p, p, False) for p in "ABCD"]
        returning = [
            ("before", "A", True),
            ("kill", "E", False),
            ("after-B", "B", True),
            ("after-C", "C", True),
        ]
        a = _engine(d, "a", tiny_model, pod.info["url"], cold + returning)
        engines.append(a.start())
        a.wait_done("warmup")
        s["cold"] = {p: a.step(p) for p in "ABCD"}
        s["before"] = a.step("before")
        # the sidecar is killed while E's chunks are being saved, and its container starts again
        port = pod.info["port"]
        restart = lambda: start_sidecar(d / "pod", "64Mi", [], *POD, port=port)  # noqa: E731
        pod = kill_sidecar_mid_save(a, "kill", pod, restart)
        s["kill"] = a.wait_done("kill")["outputs"][0]
        s["after-B"] = a.step("after-B")
        s["seconds_to_hit"] = time.monotonic() - pod.info["killed_at"]
        s["after-C"] = a.step("after-C")
        s["restarted_stats"] = SidecarClient(pod.info["url"], timeout=5).stats()
        a.finish()

        # vLLM restarted with new flags, the same weights: a new engine process on the same sidecar,
        # its own prefix cache empty
        b = _engine(d, "b", tiny_model, pod.info["url"], [("first", "D", False), ("second", "A", False)],
                    max_model_len=1024, kv_cache_bytes=32 << 20)  # fmt: skip
        engines.append(b.start())
        b.wait_done("warmup")
        s["b-first"] = b.step("first")
        s["b-second"] = b.step("second")
        b.finish()
        s["logs"] = "".join(e.log.read_text(errors="replace") for e in engines)
        yield s
    finally:
        for e in engines:
            e.kill()
        pod.stop()


def _same(out: dict[str, Any], cold: dict[str, Any]) -> None:
    assert out["token_ids"] == cold["token_ids"]
    assert out["logprobs"] == cold["logprobs"]  # bit-identical floats


def test_a_sidecar_killed_mid_save_comes_back_warm(story) -> None:
    before = story["before"]["num_cached_tokens"]
    assert before >= 512  # all of A's whole chunks came from kvpool before the kill
    stats = story["restarted_stats"]
    assert stats["adopted"] > 0  # the restarted sidecar took the arena's chunks back
    for label, prompt in (("after-B", "B"), ("after-C", "C")):
        # as much of B and C (saved before the kill, as long as A) as of A before it
        assert story[label]["num_cached_tokens"] == before, label
        _same(story[label], story["cold"][prompt])
    _same(story["before"], story["cold"]["A"])
    assert "Traceback" not in story["logs"]


def test_a_restarted_vllm_finds_its_prefixes_in_the_sidecar(story) -> None:
    for label, prompt in (("b-first", "D"), ("b-second", "A")):
        assert story[label]["num_cached_tokens"] == story["before"]["num_cached_tokens"], label
        _same(story[label], story["cold"][prompt])
