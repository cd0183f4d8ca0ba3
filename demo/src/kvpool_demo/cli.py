"""`kvpool`: the user command. `kvpool demo` shows the connector at work on this machine: a few
users' conversations through vLLM's OpenAI server alone and with kvpool, one answered by a second
engine through a shared Redis tier. `kvpool stats URL` prints a sidecar's statistics."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .localrun import kvpool_connector_spec, redis_server, sidecar, sidecar_stats, vllm_server
from .openai_driver import Sample, drive
from .tinymodel import DEMO, make_model
from .workloads import Turn, multi_round_qa

CHUNK = 256
BLOCK = 64
ENGINE_BLOCKS = 16  # vLLM's own KV cache: 1,024 tokens, a third of the conversations' working set
USERS, ROUNDS = 4, 3


def _say(msg: str) -> None:
    print(f"[kvpool demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _server(model: Path, log: Path, connector: dict | None = None) -> Any:
    # Prefill in one-block steps: every arm then computes each token with the same arithmetic
    # (vLLM's CPU kernels are not batch-invariant), so outputs can be compared bit for bit.
    return vllm_server(
        model,
        log,
        kv_cache_bytes=ENGINE_BLOCKS * BLOCK * DEMO.kv_bytes_per_token,
        connector=connector,
        block_size=BLOCK,
        max_model_len=(ENGINE_BLOCKS - 1) * BLOCK,
        max_num_batched_tokens=BLOCK,
        max_num_seqs=4,
    )


def _p50(samples: list[Sample], rnd: int) -> float:
    return statistics.median(s.ttft for s in samples if s.turn.round == rnd)


def demo(args: argparse.Namespace) -> int:
    cache = Path(args.model_dir or Path.home() / ".cache" / "kvpool" / "demo-llama")
    _say(f"making a random-weight Llama ({DEMO.layers} layers, hidden {DEMO.hidden}) in {cache} ...")
    model = make_model(cache, DEMO)
    turns = multi_round_qa(
        USERS, ROUNDS + 1, system=256, history=512, question=32, answer=8, vocab=DEMO.vocab, seed=1
    )
    talk, last = [t for t in turns if t.round <= ROUNDS], next(t for t in turns if t.round == ROUNDS + 1)
    one: list[Turn] = [last]
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as d, contextlib.ExitStack() as stack:
        work = Path(d)
        _say("starting three vLLM OpenAI servers (CPU engine, prefix caching on, KV for 1,024 tokens each);")
        _say("each takes about a minute. First: vLLM alone ...")
        alone_url = stack.enter_context(_server(model, work / "vllm-alone.log"))
        redis = stack.enter_context(redis_server(work / "redis"))
        pods = []
        for pod in ("a", "b"):
            side = stack.enter_context(sidecar(work / f"sidecar-{pod}", "1Gi", redis_url=redis))
            _say(f"vLLM with kvpool, pod {pod} (its own sidecar, one Redis shared by both pods) ...")
            url = stack.enter_context(
                _server(model, work / f"vllm-{pod}.log", kvpool_connector_spec(side, CHUNK))
            )
            pods.append((url, side))
        _say(f"{USERS} users x {ROUNDS} rounds, users taking turns, through vLLM alone and through pod a ...")
        alone = drive([alone_url], talk + one)
        kvpool = drive([pods[0][0]], talk)
        _say(f"user {last.user + 1}'s round {last.round} goes to pod b, which never saw the conversation ...")
        (cross,) = drive([pods[1][0]], one)
        stats = [sidecar_stats(side) for _, side in pods]
    print()
    print(
        f"  {USERS} users x {ROUNDS} rounds, 256-token system prompt, "
        f"round-1 prompts of {len(talk[0].prompt)} tokens:"
    )
    print(
        f"  a working set of ~{len(talk[-1].prompt) * USERS} tokens; vLLM's own KV cache holds "
        f"{ENGINE_BLOCKS * BLOCK}"
    )
    print()
    print("  round | TTFT p50, vLLM alone | TTFT p50, vLLM + kvpool | prompt tokens from kvpool")
    for r in range(1, ROUNDS + 1):
        loaded = sum(s.connector_tokens for s in kvpool if s.turn.round == r)
        total = sum(len(s.turn.prompt) for s in kvpool if s.turn.round == r)
        print(f"  {r:>5} | {_p50(alone, r):>17.3f} s | {_p50(kvpool, r):>20.3f} s | {loaded:>6} of {total}")
    print(
        f"  pod b | {alone[-1].ttft:>17.3f} s | {cross.ttft:>20.3f} s | {cross.connector_tokens:>6} of "
        f"{len(last.prompt)} (through Redis, written by pod a)"
    )
    hits = sum(st["hits"] for st in stats)
    asked = hits + sum(st["misses"] for st in stats)
    print(
        f"  sidecars: hit rate {hits / max(1, asked):.2f} ({hits} of {asked} chunk lookups), "
        f"{sum(st['promotions'] for st in stats)} chunks promoted from Redis"
    )
    same = sum(a.output == b.output for a, b in zip(alone, [*kvpool, cross], strict=True))
    agree = same == len(alone)
    print(f"  outputs agree: {'yes' if agree else 'NO'} ({same} of {len(alone)} answers token for token)")
    return 0 if agree and cross.connector_tokens > 0 and sum(s.connector_tokens for s in kvpool) > 0 else 1


def stats(args: argparse.Namespace) -> int:
    print(json.dumps(sidecar_stats(args.url), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="a few users' conversations through vLLM alone and through vLLM with kvpool"
    )
    d.add_argument("--model-dir", help="where to make (or reuse) the demo model [~/.cache/kvpool/demo-llama]")
    d.set_defaults(func=demo)
    s = sub.add_parser("stats", help="print a sidecar's /stats")
    s.add_argument("url", nargs="?", default="http://127.0.0.1:7070")
    s.set_defaults(func=stats)
    sub.add_parser(
        "doctor", help="what keeps this cluster's pools from serving, and how to fix it", add_help=False
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        from kvpool_operator import doctor

        return doctor.main(rest)
    return args.func(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
