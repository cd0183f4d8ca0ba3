"""KV capacity of a hybrid model (windowed and full-attention layers alternate, as in Gemma 2 and
gpt-oss) on the vLLM CPU engine: vLLM alone, with kvpool, and with kvpool as it was before it declared
SupportsHMA (vLLM then turned its hybrid KV cache manager off: every layer held every token).

Measured: the same KV memory (64 MiB) in every arm, a batch of 8 requests (1,800-token prompts, 32
tokens out) submitted at once; the most requests vLLM's scheduler ran at the same time, read off the
scheduler after each step (each arm runs its engine in its own process, in-process core). Also the
KV blocks vLLM made. These are counts, not timings: they do not vary between runs.
Run: `.venv/bin/python -m bench hybrid`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpool_demo.localrun import engine_env, kvpool_connector_spec, sidecar
from kvpool_demo.tinymodel import ModelShape, make_model, random_prompt

# Gemma 2-style: window 128 tokens, 8 layers, every other layer full attention
SHAPE = ModelShape(layers=8, sliding_window=128, full_attention_every=2)
REQUESTS, PROMPT, OUT = 8, 1800, 32


def _spec(model: Path, connector: dict[str, Any] | None, hma_off: bool) -> dict[str, Any]:
    return {
        "model": str(model),
        "block_size": 32,
        "kv_cache_bytes": 64 << 20,
        "max_model_len": 4096,
        "enable_prefix_caching": True,
        "connector": connector,
        "disable_hybrid_kv_cache_manager": True if hma_off else None,
    }


def _arm(spec: dict[str, Any]) -> dict[str, Any]:
    """In the arm's own process: runs the batch and counts what the scheduler ran at once."""
    from vllm import SamplingParams

    from kvpool_demo.engine_run import build_llm

    llm = build_llm(spec)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    most = 0
    schedule = scheduler.schedule

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal most
        out = schedule(*args, **kwargs)
        most = max(most, len(scheduler.running))
        return out

    scheduler.schedule = counted
    prompts = [{"prompt_token_ids": random_prompt(PROMPT, SHAPE.vocab, i)} for i in range(REQUESTS)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    config = scheduler.kv_cache_config
    return {
        "most_running": most,
        "served": sum(len(o.outputs[0].token_ids) == OUT for o in outs),
        "num_blocks": config.num_blocks,
        "groups": [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups],
    }


def _run(spec: dict[str, Any], d: Path, name: str) -> dict[str, Any]:
    spec_path, out = d / f"{name}.spec.json", d / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    with (d / f"{name}.log").open("wb") as log, engine_env() as env:
        argv = [sys.executable, "-m", "bench.hybrid_bench", str(spec_path), str(out)]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1200, check=True)
    return json.loads(out.read_text())


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-hybrid-") as tmp:
        d = Path(tmp)
        model = make_model(d / "model", SHAPE)
        rows = []
        with sidecar(d / "sidecar", capacity="256Mi") as url:
            for arm, connector, hma_off in (
                ("vLLM alone", None, False),
                ("kvpool", kvpool_connector_spec(url, chunk_size=256), False),
                ("kvpool before SupportsHMA", kvpool_connector_spec(url, chunk_size=256), True),
            ):
                rows.append((arm, _run(_spec(model, connector, hma_off), d, arm.split()[-1])))
    base = rows[0][1]["most_running"]
    print(
        f"model: {SHAPE.layers} layers, window {SHAPE.sliding_window}, full attention every "
        f"{SHAPE.full_attention_every}; 64 MiB of KV; {REQUESTS} requests of {PROMPT} + {OUT} tokens at once"
    )
    print(f"{'arm':28} {'KV groups':>9} {'KV blocks':>9} {'ran at once':>11} {'ratio':>6} {'served':>6}")
    for arm, r in rows:
        print(
            f"{arm:28} {len(r['groups']):>9} {r['num_blocks']:>9} {r['most_running']:>11} "
            f"{r['most_running'] / base:>6.2f} {r['served']:>6}"
        )


if __name__ == "__main__":
    if len(sys.argv) == 3:  # one arm, in its own process
        Path(sys.argv[2]).write_text(json.dumps(_arm(json.loads(Path(sys.argv[1]).read_text()))))
    else:
        main()
