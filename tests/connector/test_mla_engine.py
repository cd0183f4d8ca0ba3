"""A DeepSeek-V2-style model (multi-head latent attention) at tensor parallel 2 on the real vLLM CPU
engine (a worker process per rank), one real sidecar process.

MLA's latent KV is computed by replicated layers and held whole by every TP rank: the same bytes on
each. kvpool stores one copy per pipeline stage (TP rank 0 saves it, every rank loads it), as vLLM's
own offloading does, where it used to store one per rank: twice the arena and Redis for nothing.

The reference is vLLM's ExampleConnector, warm, at TP 2 in the same shape of run: both load the same
288 tokens and compute the last 12 in one step, so logprobs are compared bit for bit. (A cold run is
no reference here: with prefix caching off, as vLLM's CPU platform forces for MLA, computing 12
tokens over a loaded prefix is another step shape than the whole prompt at once.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enginekit import Engine, engine_spec, kvpool_connector
from kvtest import start_sidecar

from kvpool_demo.tinymodel import TINY_MLA, make_model, random_prompt
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.engine

TP = 2
BLOCK = 16  # vLLM's CPU MLA kernel takes no other
PROMPT = random_prompt(300, 512, seed=31)  # 4 full chunks of 64 tokens and a 44-token tail
CHUNKS = 5  # the full chunks and the tail's 32 whole-block tokens (288 tokens)
LATENT_BYTES = (512 + 64) * 4  # a token's latent KV in one layer, float32


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-mla", TINY_MLA)


def _run_tp2(d: Path, name: str, model: Path, connector: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompt cold, then twice warm (vLLM's prefix cache is off for MLA on the CPU: each warm run
    loads from the connector)."""
    engine = Engine(d, name, {}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    runs = [{"label": label, "prompts": [PROMPT], "max_tokens": 4} for label in ("cold", "warm", "again")]
    engine.spec = engine_spec(
        model,
        connector,
        runs,
        block_size=BLOCK,
        max_num_batched_tokens=None,
        tensor_parallel_size=TP,
        # vLLM's reference MLA backend: on a CPU with AMX vLLM picks AMX_MLA, which takes bf16 weights
        # only and refuses this float32 model at load (seen on a Sapphire Rapids CI-like machine)
        attention_backend="CPU_MLA",
    )
    engine.start()
    try:
        outs = [engine.wait_done(label)["outputs"][0] for label in ("cold", "warm", "again")]
        engine.finish()
        return outs
    finally:
        engine.kill()


def test_latent_kv_is_stored_once_and_every_rank_loads_it(tmp_path, mla_model) -> None:
    example = {"name": "ExampleConnector", "extra": {"shared_storage_path": str(tmp_path / "files")}}
    reference = _run_tp2(tmp_path, "example", mla_model, example)
    sidecar = start_sidecar(tmp_path / "sidecar", "64Mi")
    try:
        client = SidecarClient(sidecar.info["url"], timeout=5)
        outs = _run_tp2(tmp_path, "kvpool", mla_model, kvpool_connector(sidecar.info["url"], timeout_ms=5000))
        stats = client.stats()
    finally:
        sidecar.stop()
    cold, warm, again = outs
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] == again["num_cached_tokens"] == 288
    for mine, ref in zip((warm, again), reference[1:], strict=True):
        assert mine["token_ids"] == ref["token_ids"]
        assert mine["logprobs"] == ref["logprobs"]  # bit-identical floats: the same step shapes
    # one copy of each chunk, not one per rank: 288 tokens of latent KV in 2 layers
    assert stats["chunks"] == CHUNKS
    assert stats["stored_bytes"] == 288 * TINY_MLA.layers * LATENT_BYTES
    assert stats["bytes_out"] == 2 * TP * stats["stored_bytes"]  # both warm runs, on both ranks
    log = (tmp_path / "kvpool.log").read_text()
    assert "loads only: another TP rank saves the same KV" in log  # rank 1
