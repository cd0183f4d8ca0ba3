"""`kvpool`: the user command. `kvpool demo` shows the connector at work on this machine;
`kvpool stats URL` prints a sidecar's statistics."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .localrun import kvpool_connector_spec, run_engine, sidecar, sidecar_stats
from .tinymodel import DEMO, make_model, random_prompt

CHUNK = 256
# 2,049 tokens: the warm run loads 2,048 and recomputes the last one. The engine prefills in steps of
# one chunk, so the cold and the warm run compute that last token with the same arithmetic (vLLM's
# CPU kernels are not batch-invariant: a different number of rows changes the last bits).
PROMPT_TOKENS = 2049


def _say(msg: str) -> None:
    print(f"[kvpool demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo(args: argparse.Namespace) -> int:
    cache = Path(args.model_dir or Path.home() / ".cache" / "kvpool" / "demo-llama")
    _say(f"making a random-weight Llama ({DEMO.layers} layers, hidden {DEMO.hidden}) in {cache} ...")
    model = make_model(cache, DEMO)
    p = random_prompt(PROMPT_TOKENS, DEMO.vocab, seed=1)
    q = random_prompt(PROMPT_TOKENS, DEMO.vocab, seed=2)
    runs = [
        {"label": "warmup", "prompts": [random_prompt(300, DEMO.vocab, seed=3)], "max_tokens": 1},
        {"label": "cold_ttft", "prompts": [p], "max_tokens": 1},
        {"label": "warm_ttft", "prompts": [p], "max_tokens": 1},
        {"label": "cold", "prompts": [q], "max_tokens": 16},
        {"label": "warm", "prompts": [q], "max_tokens": 16},
    ]
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as d:
        work = Path(d)
        with sidecar(work / "sidecar", "1Gi") as url:
            _say(f"sidecar serving on {url} (arena in {work / 'sidecar' / 'arena'})")
            _say("starting vLLM (CPU engine) with the kvpool connector; this takes about a minute ...")
            spec = {
                "model": str(model),
                "block_size": 32,
                "kv_cache_bytes": 256 << 20,
                "max_model_len": 4096,
                "max_num_batched_tokens": CHUNK,
                "connector": kvpool_connector_spec(url, CHUNK),
                "runs": runs,
            }
            r = run_engine(spec, work, "demo")
            stats = sidecar_stats(url)
    cold, warm = r["cold_ttft"]["seconds"], r["warm_ttft"]["seconds"]
    same = all(
        r[a]["outputs"][0]["token_ids"] == r[b]["outputs"][0]["token_ids"]
        and r[a]["outputs"][0]["logprobs"] == r[b]["outputs"][0]["logprobs"]
        for a, b in (("cold_ttft", "warm_ttft"), ("cold", "warm"))
    )
    loaded = r["warm_ttft"]["outputs"][0]["num_cached_tokens"]
    print()
    print(f"  prompt                 {PROMPT_TOKENS} tokens, vLLM prefix caching off")
    print(f"  time to first token    cold {cold:.3f} s   warm {warm:.3f} s   ({cold / warm:.1f}x faster)")
    print(f"  loaded from kvpool     {loaded} tokens (the last one is always recomputed)")
    print(
        f"  sidecar                hit rate {stats['hit_rate']:.2f} ({stats['hits']} chunk hits, "
        f"{stats['misses']} misses), {stats['chunks']} chunks, {stats['stored_bytes'] / 2**20:.1f} MiB stored"
    )
    print(f"  outputs identical      {'yes' if same else 'NO'} (token ids and logprobs, bit for bit)")
    return 0 if same and loaded > 0 else 1


def stats(args: argparse.Namespace) -> int:
    print(json.dumps(sidecar_stats(args.url), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="a tiny model, a sidecar, one long prompt twice through vLLM")
    d.add_argument("--model-dir", help="where to make (or reuse) the demo model [~/.cache/kvpool/demo-llama]")
    d.set_defaults(func=demo)
    s = sub.add_parser("stats", help="print a sidecar's /stats")
    s.add_argument("url", nargs="?", default="http://127.0.0.1:7070")
    s.set_defaults(func=stats)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
