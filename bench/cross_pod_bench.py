"""Returning users whose last round another pod served (#24 item 3), through vLLM's OpenAI server: the
round trips kvpool's lookups make to the sidecar inside vLLM's scheduler, and the returning users' TTFT,
for kvpool at a base revision against kvpool from this tree, wave by wave.

A router that does not follow prefixes sends most returning users to another pod than their last
round's. That pod has not seen their chunks stored, so its lookup guesses a miss at the first chunk
vLLM lacks and asks that chunk's shorter tails; the prefix found runs on to where the last round's
partial tail is, and the tails there are a second round trip inside schedule() (`tail_lookups`)
unless the lookup was sent again before (`lookups_guessed_again`).

Each arm is two pods, each a vLLM server with its own sidecar, the sidecars sharing one Redis (bench
workloads' "kvpool, 2 engines via Redis"); the base's pods run, sidecars and all, from a git worktree of
KVPOOL_BASE (default HEAD) put first on their PYTHONPATH. The waves are bench paired's returning users
(16 users behind a 128-token system prompt, 3 rounds), each wave one round of `concurrency` users,
released at once to one pod of each arm in turn, the first arm alternating: round r to pod r % 2, so
every returning round's last round was on the other pod. The TTFT ratios are over the waves of rounds
2 and 3; the connector's counters are read off every pod's /metrics around each level.
Run: `KVPOOL_BASE=<rev> .venv/bin/python -m bench cross_pod` (about 20 minutes on 2 cores); BASE_FIRST =
False starts this tree's pods first.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

from bench.load_bench import ENGINE_BLOCKS, FLOOR_BLOCKS, LEVELS, request, unique_prompts
from bench.paired_bench import HEAD, Wave, released, returning, returning_users, row
from bench.returning_lookups_bench import beside_base
from bench.stats import load_note
from bench.workloads_bench import arms
from kvpool_demo.openai_driver import client, counters
from kvpool_demo.tinymodel import BENCH, make_model
from kvpool_demo.workloads import Turn

TWO_PODS = "kvpool, 2 engines via Redis"
# Which arm starts first: a server started second has run a few percent faster (bench
# returning_lookups), so a run with the order swapped tells the change from the processes
BASE_FIRST = True
WATCHED = {
    name: f"vllm:kvpool_{name}_total"
    for name in ("lookups", "tail_lookups", "lookups_guessed_again", "lookup_seconds", "loaded_chunks")
}


def by_pods(pods: dict[str, list[str]], turns: list[Turn], concurrency: int) -> dict[str, list[Wave]]:
    """Sends `turns` in waves of `concurrency` (one round each) to pod `round % 2` of every arm of
    `pods`, the first arm alternating from wave to wave."""
    names = list(pods)
    apis = {(a, p): [client(url) for _ in range(concurrency)] for a in names for p, url in enumerate(pods[a])}
    out: dict[str, list[Wave]] = {a: [] for a in names}
    with ThreadPoolExecutor(concurrency) as pool:
        for w in range(0, len(turns), concurrency):
            wave, first = turns[w : w + concurrency], (w // concurrency) % len(names)
            assert len({t.round for t in wave}) == 1, "a wave holds one round"
            pod = wave[0].round % 2
            for arm in names[first:] + names[:first]:
                out[arm].append(released(pods[arm][pod], apis[(arm, pod)], wave, pool))
    return out


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    two_pods = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)[TWO_PODS][0]
    lines: list[str] = []
    counts: list[str] = []
    with beside_base() as (rev, d, base_path, stack):
        base, this = f"kvpool at {rev}", "kvpool, this tree"
        pods: dict[str, list[str]] = {}
        for i, name in enumerate((base, this) if BASE_FIRST else (this, base)):
            with mock.patch.dict(os.environ, base_path if name == base else {}):
                pods[name] = stack.enter_context(two_pods(d / f"arm{i}"))
            for url in pods[name]:
                request(client(url), unique_prompts(1, seed=99)[0])  # warm-up
        print(f"(servers up; {load_note()})", flush=True)
        for level in LEVELS:
            before = {(a, url): counters(url, WATCHED) for a, urls in pods.items() for url in urls}
            waves = by_pods(pods, returning_users(level), level)
            after = {key: counters(key[1], WATCHED) for key in before}
            kept = [i for i, w in enumerate(waves[base]) if returning(w)]
            b, k = ([waves[a][i] for i in kept] for a in (base, this))
            lines.append(row(level, f"returning users, the other pod's: {this} / {base}", b, k))
            print(lines[-1], flush=True)
            for a in pods:
                n = {c: sum(after[key][c] - before[key][c] for key in before if key[0] == a) for c in WATCHED}
                counts.append(
                    f"| {level} | {a} | {n['lookups']:.0f} | {n['tail_lookups']:.0f} | "
                    f"{n['lookups_guessed_again']:.0f} | "
                    f"{1000 * n['lookup_seconds'] / max(n['lookups'], 1):.2f} | {n['loaded_chunks']:.0f} |"
                )
    print("\n".join(["Wave by wave, rounds 2 and 3 (95% intervals):", *HEAD, *lines]))
    print(
        "\n".join(
            [
                "Every request of the level (rounds 1 to 3), both pods of an arm, read off /metrics:",
                "| concurrency | arm | lookups | second round trips (tail_lookups) "
                "| sent again with the chunk found | ms in lookups a lookup | chunks loaded |",
                "| --- " * 7 + "|",
                *counts,
            ]
        )
    )
    print(f"({load_note()})")
