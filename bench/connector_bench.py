"""Connector figures: time to first token on the vLLM CPU engine, cold, warm through kvpool, and warm
through vLLM's own file-based ExampleConnector (its files in /dev/shm), as ratios to cold.

Model: random-weight Llama, hidden 1024, 8 layers, 16 heads, 4 KV heads, float32 (the model of
../shared notes on other connectors); prompts of 2,000 random tokens; max_tokens 1; temperature 0.
vLLM's own prefix cache is measured too, as the floor a warm run can reach.
Each case runs in a fresh engine process with one warm-up prompt first, and one compute thread
(VLLM_CPU_OMP_THREADS_BIND=0) in every case. Cold: median and range over 5 prompts; warm: each prompt
is sent 4 more times after its cold run (every warm run loads again: prefix caching is off), median
and range over those 20.
Run: `.venv/bin/python -m bench connector`.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.stats import load_note
from kvpool_demo.localrun import kvpool_connector_spec, run_engine, sidecar, sidecar_stats
from kvpool_demo.tinymodel import BENCH, make_model, random_prompt

PROMPT_TOKENS = 2000
REPEAT = 5
WARM_REPEAT = 4  # warm runs are cheap and the difference between connectors is a few ms: more samples
BLOCK = 64


def _spec(
    model: Path, connector: dict[str, Any] | None, warm: bool, prefix_caching: bool = False
) -> dict[str, Any]:
    runs = [{"label": "warmup", "prompts": [random_prompt(PROMPT_TOKENS, BENCH.vocab, 999)], "max_tokens": 1}]
    for i in range(REPEAT):
        p = random_prompt(PROMPT_TOKENS, BENCH.vocab, i)
        runs.append({"label": f"cold{i}", "prompts": [p], "max_tokens": 1})
        if warm:
            runs += [{"label": f"warm{i}.{j}", "prompts": [p], "max_tokens": 1} for j in range(WARM_REPEAT)]
    return {
        "model": str(model),
        "block_size": BLOCK,
        "kv_cache_bytes": 512 << 20,
        "max_model_len": 4096,
        "max_num_batched_tokens": 2048,
        "connector": connector,
        "runs": runs,
        "enable_prefix_caching": prefix_caching,
    }


def _labels(kind: str) -> list[str]:
    if kind == "cold":
        return [f"cold{i}" for i in range(REPEAT)]
    return [f"warm{i}.{j}" for i in range(REPEAT) for j in range(WARM_REPEAT)]


def _times(results: dict[str, Any], kind: str) -> list[float]:
    return [results[label]["seconds"] for label in _labels(kind)]


def _fmt(name: str, xs: list[float], base: float) -> str:
    m = statistics.median(xs)
    return f"| {name} | {m:.3f} s [{min(xs):.3f}-{max(xs):.3f}] | {m / base:.3f} |"


def _same(results: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Every warm run's first token is the cold run's (warm{i}.{j} repeats cold{i}'s prompt)."""
    first = {label: r["outputs"][0]["token_ids"] for label, r in reference.items()}
    return all(
        results[label]["outputs"][0]["token_ids"] == first[f"cold{label[4:].split('.')[0]}"]
        for label in _labels("warm")
    )


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as shm:
        work = Path(shm)
        cold = run_engine(_spec(model, None, warm=False), work, "cold")
        with sidecar(work / "sidecar", "2Gi") as url:
            kvpool = run_engine(_spec(model, kvpool_connector_spec(url), warm=True), work, "kvpool")
            hit_rate = sidecar_stats(url)["hit_rate"]
        # vLLM's own prefix cache in GPU (here CPU) memory: what a warm run costs with no transfer at all
        prefix = run_engine(_spec(model, None, warm=True, prefix_caching=True), work, "prefix")
        (work / "example").mkdir()
        example_conn = {"name": "ExampleConnector", "extra": {"shared_storage_path": str(work / "example")}}
        example = run_engine(_spec(model, example_conn, warm=True), work, "example")
    base = statistics.median(_times(cold, "cold"))
    print(
        f"TTFT, {PROMPT_TOKENS}-token prompt, {BENCH.layers} layers x {BENCH.kv_heads} KV heads x "
        f"{BENCH.head_size}, float32, block {BLOCK}, chunk 256, median [range] of {REPEAT} cold, "
        f"{REPEAT * WARM_REPEAT} warm"
    )
    print("| case | TTFT | / cold |")
    print("| --- | --- | --- |")
    print(_fmt("cold, no connector", _times(cold, "cold"), base))
    print(_fmt("kvpool, first run (saving)", _times(kvpool, "cold"), base))
    print(_fmt("kvpool, warm", _times(kvpool, "warm"), base))
    print(_fmt("vLLM prefix caching, warm (no transfer: the floor)", _times(prefix, "warm"), base))
    print(_fmt("ExampleConnector, first run (saving)", _times(example, "cold"), base))
    print(_fmt("ExampleConnector, warm", _times(example, "warm"), base))
    warm_k, warm_e = statistics.median(_times(kvpool, "warm")), statistics.median(_times(example, "warm"))
    print(
        f"kvpool warm / ExampleConnector warm: {warm_k / warm_e:.3f}; sidecar hit rate {hit_rate:.2f}; "
        f"first tokens identical to cold: kvpool {_same(kvpool, cold)}, "
        f"ExampleConnector {_same(example, cold)}"
    )
