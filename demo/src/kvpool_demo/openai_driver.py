"""Sends turns to vLLM's OpenAI-compatible server the way a user's client does (streaming, one at a
time) and reads where each turn's prompt tokens came from off the server's own /metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openai import OpenAI, Stream
from openai.types import Completion

from .workloads import Turn

# vLLM's counters (summed over their labels): prompt tokens, and those served by its own prefix cache
# and by the KV connector; what neither served was computed.
COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "engine": "vllm:prefix_cache_hits_total",
    "connector": "vllm:external_prefix_cache_hits_total",
}


@dataclass
class Sample:
    turn: Turn
    server: int  # which of the servers answered
    ttft: float  # seconds from sending to the first streamed token, at the client
    seconds: float  # to the last token
    output: list[int]  # generated token ids
    engine_tokens: int  # prompt tokens from vLLM's prefix cache
    connector_tokens: int  # prompt tokens from the KV connector

    @property
    def computed_tokens(self) -> int:
        return len(self.turn.prompt) - self.engine_tokens - self.connector_tokens


def counters(url: str, which: dict[str, str] = COUNTERS) -> dict[str, float]:
    """The values of `which` (short name: metric) on the server at `url` now."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(which, 0.0)
    names = {v: k for k, v in which.items()}
    for line in text.splitlines():
        name, _, value = line.partition("{") if "{" in line else line.partition(" ")
        if name in names:
            out[names[name]] += float(value.rsplit(" ", 1)[-1])
    return out


def client(url: str) -> OpenAI:
    """An OpenAI client of the server at `url` that never retries (a retry would hide a failure)."""
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def open_stream(
    client: OpenAI, turn: Turn, kv_transfer_params: dict[str, Any] | None = None
) -> Stream[Completion]:
    """Sends `turn` as a streamed completion, temperature 0 (with the connector's `kv_transfer_params`
    if given); returns once the server has answered with the stream's headers, before its first token."""
    extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    return client.completions.create(
        model="model",
        prompt=turn.prompt,
        max_tokens=turn.max_tokens,
        temperature=0,
        stream=True,
        extra_body=extra,
    )


def read_stream(stream: Stream[Completion], t0: float) -> tuple[float, float, list[int]]:
    """(TTFT, total seconds, output ids) of an opened stream, both times counted from `t0`."""
    ttft = None
    ids: list[int] = []
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
    seconds = time.perf_counter() - t0
    return (seconds if ttft is None else ttft), seconds, ids


def send(client: OpenAI, turn: Turn) -> tuple[float, float, list[int]]:
    """(TTFT, total seconds, output ids) of one streamed completion, temperature 0."""
    t0 = time.perf_counter()
    return read_stream(open_stream(client, turn), t0)


def drive(
    urls: Sequence[str], turns: Sequence[Turn], route: Callable[[Turn], int] = lambda t: 0
) -> list[Sample]:
    """Sends `turns` in order, each to the server `route` picks, and reads its token sources."""
    clients = [client(u) for u in urls]
    samples = []
    for turn in turns:
        i = route(turn)
        before = counters(urls[i])
        ttft, seconds, ids = send(clients[i], turn)
        after = counters(urls[i])
        samples.append(
            Sample(
                turn,
                i,
                ttft,
                seconds,
                ids,
                round(after["engine"] - before["engine"]),
                round(after["connector"] - before["connector"]),
            )
        )
    return samples
