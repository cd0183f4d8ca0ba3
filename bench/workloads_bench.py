"""Workload figures through vLLM's OpenAI-compatible server: multi-round QA, prefix repetition,
long-document QA ("tile" order) and a no-reuse control, with prefix caching on (vLLM's default) and
the engine's KV cache pinned small and equal in every arm but the floor's.

Arms, one run: vLLM alone; vLLM with KV for the whole working set (the floor: what a perfect tier
could give); kvpool with a CPU tier that holds the working set; kvpool on two engines sharing a Redis
tier, turns routed with no affinity so that a returning user, prefix or document lands on the other
engine and its hits come through Redis; vLLM's ExampleConnector (files in /dev/shm); LMCache from
PyPI in its multiprocess mode, when .venv-lmcache exists (`bash bench/lmcache-env.sh`).
Every server: the BENCH model (random-weight Llama, 8 layers, hidden 1024, float32), block 64, one
compute thread (VLLM_CPU_OMP_THREADS_BIND=0), temperature 0, token-id prompts, one request at a
time, streamed through the OpenAI client; TTFT is measured at the client. Token sources come from
the server's own /metrics (vllm:prefix_cache_hits, vllm:external_prefix_cache_hits).
Run: `.venv/bin/python -m bench workloads` (about 25 minutes on 2 cores); writes
bench/results/workloads.json and bench/results/workloads-ttft.png.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.null_connector import SPEC as NULL_SPEC
from bench.stats import load_note, pct
from kvpool_demo.localrun import (
    free_port,
    kvpool_connector_spec,
    process,
    redis_server,
    sidecar,
    vllm_server,
)
from kvpool_demo.openai_driver import Sample, drive
from kvpool_demo.tinymodel import BENCH, make_model
from kvpool_demo.workloads import (
    Turn,
    long_doc_qa,
    multi_round_qa,
    no_reuse,
    prefix_repetition,
    reusable_tokens,
)

BLOCK = 64
CHUNK = 256
ENGINE_BLOCKS = 24  # the engine's own KV cache: 1,536 tokens
FLOOR_BLOCKS = 640  # enough for every workload's working set at once
RESULTS = Path(__file__).parent / "results"
LMCACHE_VENV = Path(__file__).parent.parent / ".venv-lmcache"
NULL = "vLLM, a connector that does nothing"  # what vLLM charges any connector (null_connector.py)


def workloads() -> dict[str, list[Turn]]:
    v = BENCH.vocab
    return {
        # 8 users x 3 rounds, each round 72 tokens more than the last (more than a block, as real
        # questions are: a whole-prompt key then never matches); working set ~5,000 tokens, 3.3x the
        # engine's KV
        "multi-round QA": multi_round_qa(
            8, 3, system=256, history=384, question=64, answer=8, vocab=v, seed=11
        ),
        # 12 prefixes x 3 prompts with suffixes of 1.5 blocks, shuffled; 5,400 tokens of prefixes, 3.5x
        "prefix repetition": prefix_repetition(12, 3, prefix=448, suffix=96, answer=4, vocab=v, seed=12),
        # 4 documents x 2 passes in tile order; 4,100 tokens, 2.7x
        "long-document QA": long_doc_qa(4, doc=1024, question=16, answer=8, vocab=v, seed=13),
        "no-reuse control": no_reuse(16, 512, answer=8, vocab=v, seed=14),
    }


@dataclass
class ArmResult:
    name: str
    samples: dict[str, list[Sample]]
    walls: dict[str, float]


Servers = Callable[[Path], contextlib.AbstractContextManager[list[str]]]


def bench_server(
    model: Path,
    log: Path,
    blocks: int,
    engine_blocks: int = ENGINE_BLOCKS,
    connector: dict[str, Any] | None = None,
    **kw: Any,
) -> contextlib.AbstractContextManager[str]:
    """One arm's vLLM server: KV for `blocks`, and the model length every arm has (the floor's
    included), set by the engine's own KV of `engine_blocks`."""
    return vllm_server(
        model,
        log,
        kv_cache_bytes=blocks * BLOCK * BENCH.kv_bytes_per_token,
        connector=connector,
        block_size=BLOCK,
        max_model_len=(engine_blocks - 1) * BLOCK,
        **kw,
    )


def arms(
    model: Path, engine_blocks: int = ENGINE_BLOCKS, floor_blocks: int = FLOOR_BLOCKS
) -> dict[str, tuple[Servers, Callable[[Turn], int]]]:
    """Each arm: how to start its servers (yielding their URLs) and which server a turn goes to.
    Every arm's engine holds `engine_blocks` of KV but the floor's, which holds `floor_blocks`."""

    def _server(
        model: Path, log: Path, blocks: int, connector: dict[str, Any] | None = None, **kw: Any
    ) -> contextlib.AbstractContextManager[str]:
        return bench_server(model, log, blocks, engine_blocks, connector, **kw)

    @contextlib.contextmanager
    def alone(work: Path, blocks: int = engine_blocks) -> Iterator[list[str]]:
        with _server(model, work / "vllm.log", blocks) as url:
            yield [url]

    @contextlib.contextmanager
    def kvpool_cpu(work: Path) -> Iterator[list[str]]:
        with contextlib.ExitStack() as stack:
            side = stack.enter_context(sidecar(work / "sidecar", "2Gi"))
            spec = kvpool_connector_spec(side, CHUNK)
            yield [stack.enter_context(_server(model, work / "vllm.log", engine_blocks, spec))]

    @contextlib.contextmanager
    def kvpool_redis(work: Path) -> Iterator[list[str]]:
        with contextlib.ExitStack() as stack:
            redis = stack.enter_context(redis_server(work / "redis"))
            urls = []
            for pod in ("a", "b"):
                side = stack.enter_context(sidecar(work / f"sidecar-{pod}", "2Gi", redis_url=redis))
                spec = kvpool_connector_spec(side, CHUNK)
                urls.append(
                    stack.enter_context(_server(model, work / f"vllm-{pod}.log", engine_blocks, spec))
                )
            yield urls

    @contextlib.contextmanager
    def null(work: Path) -> Iterator[list[str]]:
        with _server(model, work / "vllm.log", engine_blocks, NULL_SPEC) as url:
            yield [url]

    @contextlib.contextmanager
    def example(work: Path) -> Iterator[list[str]]:
        (work / "files").mkdir(parents=True)
        spec = {"name": "ExampleConnector", "extra": {"shared_storage_path": str(work / "files")}}
        with _server(model, work / "vllm.log", engine_blocks, spec) as url:
            yield [url]

    @contextlib.contextmanager
    def lmcache(work: Path) -> Iterator[list[str]]:
        # its multiprocess mode, the one that runs on a CPU engine: an `lmcache server` with a CPU
        # (L1) tier that holds the working set, engine-driven transfers through shared memory
        port = free_port()
        argv = [str(LMCACHE_VENV / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--l1-size-gb", "2", "--eviction-policy", "LRU", "--chunk-size", str(CHUNK)]
        argv += ["--supported-transfer-mode", "engine_driven", "--shm-name", f"kvpool-bench-lmcache-{port}"]
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}
        spec = {"name": "LMCacheMPConnector", "extra": extra}
        python = str(LMCACHE_VENV / "bin" / "python")
        with contextlib.ExitStack() as stack:
            stack.enter_context(process(argv, work / "lmcache.log", lambda: _listening(port), "LMCache", 300))
            yield [stack.enter_context(_server(model, work / "vllm.log", engine_blocks, spec, python=python))]

    one = _to(0)
    out: dict[str, tuple[Servers, Callable[[Turn], int]]] = {
        "vLLM alone": (alone, one),
        "vLLM, KV for everything (floor)": (lambda w: alone(w, floor_blocks), one),
        "kvpool, CPU tier": (kvpool_cpu, one),
        "kvpool, 2 engines via Redis": (kvpool_redis, lambda t: (t.user + t.round) % 2),
        "ExampleConnector": (example, one),
        NULL: (null, one),
    }
    if (LMCACHE_VENV / "bin" / "lmcache").exists():
        out["LMCache (multiprocess mode)"] = (lmcache, one)
    else:
        print(f"(no LMCache arm: {LMCACHE_VENV} is missing; `bash bench/lmcache-env.sh` builds it)")
    return out


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _to(i: int) -> Callable[[Turn], int]:
    return lambda t: i


def run_arm(name: str, servers: Servers, route: Callable[[Turn], int], work: Path) -> ArmResult:
    result = ArmResult(name, {}, {})
    with servers(work) as urls:
        warm = no_reuse(1, 256, answer=2, vocab=BENCH.vocab, seed=99)
        for i in range(len(urls)):  # each server's first request pays for warm-up, outside the figures
            drive(urls, warm, _to(i))
        for wl, turns in workloads().items():
            t0 = time.perf_counter()
            result.samples[wl] = drive(urls, turns, route)
            result.walls[wl] = time.perf_counter() - t0
            print(f"  {name}: {wl} in {result.walls[wl]:.1f} s", flush=True)
    return result


def _ttfts(samples: list[Sample], rounds: Callable[[int], bool]) -> list[float]:
    return [s.ttft for s in samples if rounds(s.turn.round)]


def _later(r: int) -> bool:
    return r >= 2


def report(results: list[ArmResult]) -> list[str]:
    base = results[0]
    lines = []
    for wl, turns in workloads().items():
        reusable = reusable_tokens(turns, BLOCK)
        rounds = sorted({t.round for t in turns})
        lines += [f"### {wl}", ""]
        head = "| arm | TTFT p50 / p90, round 1 | rounds >= 2 | wall | req/s | out tok/s |"
        head += " prompt tokens: engine cache / connector / computed | reusable served | same output |"
        lines += [head, "| --- " * 9 + "|"]
        for arm in results:
            ss = arm.samples[wl]
            first = _ttfts(ss, lambda r: r == 1)
            later = _ttfts(ss, _later)
            wall = arm.walls[wl]
            eng, con = sum(s.engine_tokens for s in ss), sum(s.connector_tokens for s in ss)
            comp = sum(s.computed_tokens for s in ss)
            served = sum(
                min(s.engine_tokens + s.connector_tokens, r) for s, r in zip(ss, reusable, strict=True)
            )
            same = sum(a.output == b.output for a, b in zip(ss, base.samples[wl], strict=True))
            out_tokens = sum(len(s.output) for s in ss)
            later_txt = f"{statistics.median(later):.3f} / {pct(later, 0.9):.3f}" if later else "-"
            lines.append(
                f"| {arm.name} | {statistics.median(first):.3f} / {pct(first, 0.9):.3f} | {later_txt} | "
                f"{wall:.1f} s | {len(ss) / wall:.3f} | {out_tokens / wall:.2f} | {eng} / {con} / {comp} | "
                f"{served / max(1, sum(reusable)):.0%} | {same}/{len(ss)} |"
            )
        if len(rounds) > 1:
            lines += [
                "",
                "TTFT p50 by round (s): "
                + "; ".join(
                    f"{arm.name}: "
                    + ", ".join(
                        f"{statistics.median(_ttfts(arm.samples[wl], functools.partial(operator.eq, r))):.3f}"
                        for r in rounds
                    )
                    for arm in results
                ),
            ]
        lines.append("")
    return lines


def targets(results: list[ArmResult]) -> list[str]:
    by = {a.name: a for a in results}
    alone, floor, cpu = by["vLLM alone"], by["vLLM, KV for everything (floor)"], by["kvpool, CPU tier"]
    redis, example = by["kvpool, 2 engines via Redis"], by["ExampleConnector"]

    def p50(arm: ArmResult, wl: str, rounds: Callable[[int], bool] = _later) -> float:
        return statistics.median(_ttfts(arm.samples[wl], rounds))

    mr = "multi-round QA"
    turns = workloads()[mr]
    reusable = reusable_tokens(turns, BLOCK)
    later = [(s, r) for s, r in zip(cpu.samples[mr], reusable, strict=True) if s.turn.round >= 2]
    ext_share = sum(s.connector_tokens for s, _ in later) / max(1, sum(r - s.engine_tokens for s, r in later))
    ld = "long-document QA"
    wall_pass = {a.name: sum(s.seconds for s in a.samples[ld] if s.turn.round == 2) for a in results}
    gain = {a.name: p50(alone, mr) - p50(a, mr) for a in (cpu, redis)}
    nr = "no-reuse control"
    all_rounds: Callable[[int], bool] = lambda r: True  # noqa: E731
    return [
        f"- multi-round QA, rounds >= 2, TTFT p50: kvpool / floor = {p50(cpu, mr) / p50(floor, mr):.2f}x "
        f"(target <= 1.10x); kvpool / vLLM alone = {p50(cpu, mr) / p50(alone, mr):.3f} (target <= 0.20); "
        f"ExampleConnector / vLLM alone = {p50(example, mr) / p50(alone, mr):.3f}; connector hits = "
        f"{ext_share:.0%} of the reusable tokens vLLM's own cache no longer had (target >= 90%)",
        f"- prefix repetition, TTFT p50 over all turns: vLLM alone / kvpool = "
        f"{p50(alone, 'prefix repetition', all_rounds) / p50(cpu, 'prefix repetition', all_rounds):.2f}x "
        f"(target >= 5x)",
        f"- long-document QA, query pass: TTFT p50 {1 - p50(cpu, ld) / p50(alone, ld):.0%} better than vLLM "
        f"alone (target >= 60%), pass time {1 - wall_pass[cpu.name] / wall_pass[alone.name]:.0%} better "
        f"(target >= 15%)",
        f"- no-reuse control, TTFT p50: kvpool / vLLM alone = "
        f"{p50(cpu, nr, all_rounds) / p50(alone, nr, all_rounds):.3f} (target <= 1.02); wall "
        f"{cpu.walls[nr] / alone.walls[nr]:.3f}",
        f"- cross-pod through Redis, multi-round QA rounds >= 2: gain over vLLM alone "
        f"{gain[redis.name]:.3f} s "
        f"= {gain[redis.name] / gain[cpu.name]:.0%} of the CPU tier's {gain[cpu.name]:.3f} s (target >= 50%)",
    ]


def plot(results: list[ArmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(workloads())
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 4.2))
    for ax, wl in zip(axes, names, strict=True):
        rounds = sorted({s.turn.round for s in results[0].samples[wl]})
        for k, arm in enumerate(results):
            ys = [
                statistics.median(_ttfts(arm.samples[wl], functools.partial(operator.eq, r))) for r in rounds
            ]
            if len(rounds) > 1:
                ax.plot(rounds, ys, marker="o", label=arm.name)
                ax.set_xticks(rounds)
                ax.set_xlabel("round (times the user / prefix / document was seen)", fontsize=8)
            else:
                ax.bar([k], ys, color=f"C{k}", label=arm.name)
                ax.set_xticks([])
                ax.set_xlabel("unique prompts only", fontsize=8)
        ax.set_title(wl)
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("TTFT p50 (s)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(results), fontsize=8)
    fig.suptitle(
        "TTFT by round: vLLM CPU engine, prefix caching on, one small engine KV in all arms but the floor"
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def _record(s: Sample) -> dict[str, Any]:
    """A sample as JSON, its prompt by length only."""
    turn = {"user": s.turn.user, "round": s.turn.round, "prompt_tokens": len(s.turn.prompt)}
    return {**asdict(s), "turn": turn}


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d:
        workload_arms = [(n, arm) for n, arm in arms(model).items() if n != NULL]  # a cache each, or none
        for i, (name, (servers, route)) in enumerate(workload_arms):
            results.append(run_arm(name, servers, route, Path(d) / f"arm{i}"))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "workloads.json").write_text(
        json.dumps(
            {
                a.name: {
                    "walls": a.walls,
                    "samples": {wl: [_record(s) for s in ss] for wl, ss in a.samples.items()},
                }
                for a in results
            }
        )
    )
    plot(results, RESULTS / "workloads-ttft.png")
    print("\n".join([*report(results), "Targets:", *targets(results)]))
