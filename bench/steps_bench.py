"""Where a save's time goes: inside vLLM's step (async_saves false, kvpool before) or on the save thread
beside it (async_saves true, the default). A step trace of the real vLLM CPU engine (bench/step_trace.py).

Model: the bench's random-weight Llama (bench/connector_bench.py); 6 prompts of 2,000 random tokens
sent together, 16 tokens each, max_num_batched_tokens 512 (prefills in 512-token steps beside the
others' decodes), prefix caching on, chunk 256. Each run: a fresh engine process and a fresh sidecar
(2 GiB), so every chunk is saved. The arms alternate, PAIRS pairs, order swapped every pair.
Per step that saved: the time inside the step spent in wait_for_save (where the save ran before) and
in the fence (handle_preemptions: waiting for saves of blocks vLLM handed out again), and the step's
connector window (handle_preemptions to get_transfer_results, the forward inside it).
Run: `.venv/bin/python -m bench steps`.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.stats import load_note
from kvpool_demo.localrun import run_engine, sidecar
from kvpool_demo.tinymodel import BENCH, make_model, random_prompt

PROMPTS, PROMPT_TOKENS, MAX_TOKENS, PAIRS = 6, 2000, 16, 3
ARMS = {"in the step (async_saves false)": False, "save thread (async_saves true)": True}


def _spec(model: Path, url: str, async_saves: bool) -> dict[str, Any]:
    prompts = [random_prompt(PROMPT_TOKENS, BENCH.vocab, i) for i in range(PROMPTS)]
    return {
        "model": str(model),
        "block_size": 64,
        "kv_cache_bytes": 512 << 20,
        "max_model_len": 4096,
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": True,
        "connector": {
            "name": "TracedKVPoolConnector",
            "module": "bench.step_trace",
            "extra": {"sidecar_url": url, "chunk_size": 256, "async_saves": async_saves},
        },
        "runs": [
            {"label": "warmup", "prompts": [random_prompt(512, BENCH.vocab, 7)], "max_tokens": 1},
            {"label": "batch", "prompts": prompts, "max_tokens": MAX_TOKENS},
        ],
    }


def _run(model: Path, work: Path, name: str, async_saves: bool) -> dict[str, Any]:
    trace = work / f"{name}.trace.jsonl"
    os.environ["KVPOOL_STEP_TRACE"] = str(trace)
    with sidecar(work / f"{name}-sidecar", "2Gi") as url:
        results = run_engine(_spec(model, url, async_saves), work, name)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in lines if "step" in r and "wait_for_save" in r]
    saves = [r for r in lines if "save" in r]
    saving = {s["save"] for s in saves}
    in_step = [s for s in steps if s["step"] in saving]
    return {
        "ids": [o["token_ids"] for o in results["batch"]["outputs"]],
        "seconds": results["batch"]["seconds"],
        "wait_for_save_ms": [1000 * s["wait_for_save"] for s in in_step],
        "fence_ms": [1000 * s["fence"] for s in steps],
        "step_ms": [1000 * (s["end"] - s["start"]) for s in in_step],
        "thread_ms": sum(1000 * (s["end"] - s["start"]) for s in saves),
        "saved_chunks": sum(s["chunks"] for s in saves),
    }


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]" if xs else "-"


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    root = Path(__file__).resolve().parent.parent
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as shm:
        for pair in range(PAIRS):
            order = list(ARMS) if pair % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                name = f"{'async' if ARMS[arm] else 'sync'}{pair}"
                runs[arm].append(_run(model, Path(shm), name, ARMS[arm]))
    print(
        f"{PROMPTS} prompts x {PROMPT_TOKENS} tokens, {MAX_TOKENS} out, steps of 512 tokens, "
        f"prefix caching on, chunk 256; {PAIRS} alternating pairs, each a fresh engine and sidecar; "
        "median [range] over every step that saved, all runs of the arm"
    )
    print("| saves run | wait_for_save in the step, ms | fence in the step, ms | step, ms | batch, s |")
    print("| --- | --- | --- | --- | --- |")
    for arm, rs in runs.items():
        cols = [[x for r in rs for x in r[k]] for k in ("wait_for_save_ms", "fence_ms", "step_ms")]
        print(f"| {arm} | {' | '.join(_med(c) for c in cols)} | {_med([r['seconds'] for r in rs])} |")
    sync, async_ = runs.values()
    ratios = [a["seconds"] / s["seconds"] for s, a in zip(sync, async_, strict=True)]
    print(
        f"batch time, save thread / in the step, per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"save thread's own time per run: {_med([r['thread_ms'] for r in async_])} ms; "
        f"chunks saved per run: {sorted({r['saved_chunks'] for r in sync + async_})}; "
        f"same greedy ids in every run: {all(r['ids'] == sync[0]['ids'] for r in sync + async_)}"
    )
