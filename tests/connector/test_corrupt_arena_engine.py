"""A load that fails for a reason that does not go away ends in one recompute, never a loop (issue:
bytes changed in the arena, its header included, made vLLM loop forever).

The real vLLM CPU engine, in-process and with its default engine-core process, and a real sidecar:
- one byte changed in every 4 KiB page of the arena file, its header (magic, epoch) included: the
  sidecar notices a header it did not write, says so in /stats and /healthz, drops its chunks under
  a new epoch, and the prompt completes with the cold run's tokens; the next run hits again;
- a chunk the sidecar serves but no worker can load (planted with another length under a real key):
  one failed load for the request, which vLLM recomputes and kvpool never offers again; the
  chunk is deleted, so the next request saves and then loads it.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, engine_spec, flip_a_byte_in_every_page, kvpool_connector, prompt_keys
from kvtest import start_sidecar

from kvpool_connector.scheduler import SKIP_SAVE_PARAM
from kvpool_demo.tinymodel import random_prompt
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.wire import ARENA_FILE

pytestmark = pytest.mark.engine

P = random_prompt(450, 512, seed=81)
Q = random_prompt(450, 512, seed=82)
LOADABLE = 448  # 450 tokens: seven 64-token chunks, the last token recomputed for its logits
RECOVERED = "Recovered from KV load failure"
MODES = {"in-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "engine-core-process": {}}


@pytest.fixture(scope="module", params=list(MODES))
def story(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    mode = request.param
    d = tmp_path_factory.mktemp(f"corrupt-{mode}")
    sidecar = start_sidecar(d, "64Mi")
    client = SidecarClient(sidecar.info["url"], timeout=5)
    engine = Engine(d, "engine", {}, env=MODES[mode])
    labels = ["cold", "q_ref", "warm", "corrupt", "after", "planted", "planted_again"]
    runs = [
        {
            "label": label,
            "prompts": [Q if label.startswith(("q_", "planted")) else P],
            "max_tokens": 6,
            "wait_for": engine.go_file(label),
            # Q's reference run saves nothing: its chunk is planted later, under a key nobody saved
            "kv_transfer_params": {SKIP_SAVE_PARAM: True} if label == "q_ref" else None,
        }
        for label in labels
    ]
    connector = kvpool_connector(sidecar.info["url"], timeout_ms=1000)
    engine.spec = engine_spec(tiny_model, connector, runs)  # prefix caching off: every hit is kvpool's
    s: dict[str, Any] = {"mode": mode, "recovered": {}}

    def run(label: str) -> dict[str, Any]:
        before = engine.log.read_text(errors="replace").count(RECOVERED)
        engine.go(label)
        # a loop never ends: a short deadline (each run takes a few seconds here) shows it
        out = engine.wait_done(label, timeout=180)["outputs"][0]
        s["recovered"][label] = engine.log.read_text(errors="replace").count(RECOVERED) - before
        return out

    try:
        engine.start()
        for label in ("cold", "q_ref", "warm"):
            s[label] = run(label)
        s["pages"] = flip_a_byte_in_every_page(sidecar.info["arena_dir"] / ARENA_FILE, header=True)
        s["corrupt"] = run("corrupt")
        s["stats"] = client.stats()
        with urllib.request.urlopen(sidecar.info["url"] + "/healthz", timeout=5) as r:
            s["healthz"] = (r.status, json.loads(r.read()))
        s["after"] = run("after")
        # a chunk under Q's first key that no worker of this engine can load: a byte short
        chunk_length = len(client.get(prompt_keys(tiny_model, P)[0]) or b"")
        assert chunk_length > 0 and client.put(prompt_keys(tiny_model, Q)[0], b"\x01" * (chunk_length - 1))
        s["planted"] = run("planted")
        s["planted_again"] = run("planted_again")
        engine.finish()
        s["log"] = engine.log.read_text(errors="replace")
        yield s
    finally:
        engine.kill()
        client.close()
        sidecar.stop()


def _same_tokens(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert out["token_ids"] == ref["token_ids"]
    # recomputed in the same step shapes here; float noise is allowed, a wrong KV is far beyond it
    assert all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in zip(out["logprobs"], ref["logprobs"], strict=True)
    )


def test_the_warm_run_loads_before_the_corruption(story) -> None:
    assert story["warm"]["num_cached_tokens"] == LOADABLE
    _same_tokens(story["warm"], story["cold"])


def test_a_changed_header_ends_in_one_recompute_and_the_sidecar_reinitialises(story) -> None:
    assert story["pages"] > 16_000  # 64 MiB and the header page
    _same_tokens(story["corrupt"], story["cold"])
    assert story["recovered"]["corrupt"] <= LOADABLE // 64  # at most one failed load per chunk
    stats = story["stats"]
    assert stats["arena_reinitialised"] == 1
    assert "header changed" in stats["arena_fault"]
    status, health = story["healthz"]
    assert status == 200 and "header changed" in health["arena_fault"]


def test_after_the_reinitialisation_the_prompt_hits_again(story) -> None:
    assert story["after"]["num_cached_tokens"] == LOADABLE
    _same_tokens(story["after"], story["cold"])


def test_a_chunk_no_worker_can_load_fails_once_and_is_never_offered_again(story) -> None:
    assert story["q_ref"]["num_cached_tokens"] == 0
    _same_tokens(story["planted"], story["q_ref"])
    assert story["recovered"]["planted"] == 1
    assert "expected" in story["log"] and "deleted" in story["log"]
    # deleted by the worker, saved by the recompute, loaded by the next request
    assert story["planted_again"]["num_cached_tokens"] == LOADABLE
    _same_tokens(story["planted_again"], story["q_ref"])
