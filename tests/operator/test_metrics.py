"""The operator's metrics module: what counts as failing open, and per-pool series that go with their pool."""

from __future__ import annotations

from kvpool_operator import metrics


def value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def test_only_the_operators_own_failures_count_as_failing_open() -> None:
    # each reason exported at 0 before its first failure, so that the first one is an increase
    before = value("kvpool_operator_webhook_fail_open_total", reason="NotReady")
    assert before is not None and value("kvpool_operator_webhook_fail_open_total", reason="Error") is not None
    count = value("kvpool_operator_webhook_duration_seconds_count") or 0
    metrics.webhook_decided("NotReady", 0.001)
    metrics.webhook_decided("HostNetwork", 0.002)  # the pod's doing: admitted untouched, not failing open
    metrics.webhook_decided("Injected", 0.003)
    assert value("kvpool_operator_webhook_fail_open_total", reason="NotReady") == before + 1
    assert value("kvpool_operator_webhook_fail_open_total", reason="HostNetwork") is None
    assert value("kvpool_operator_webhook_decisions_total", reason="HostNetwork") is not None
    assert value("kvpool_operator_webhook_duration_seconds_count") == count + 3


def test_a_pool_no_longer_refreshed_here_loses_its_series() -> None:
    metrics.pool_refreshed("ml", "gone", True, 2, 1, (2, 1))
    metrics.pool_refreshed("ml", "kept", False, 1, 0, None)
    assert value("kvpool_operator_pool_shards_desired", namespace="ml", pool="gone") == 2
    assert value("kvpool_operator_pool_shards_ready", namespace="ml", pool="gone") == 1
    assert value("kvpool_operator_sidecar_scrape_failures_total", namespace="ml", pool="gone") == 1
    metrics.keep_pools([("ml", "kept")])  # "gone" deleted, or refreshed by another replica now
    for name in ("kvpool_operator_pool_ready", "kvpool_operator_pool_shards_desired"):
        assert value(name, namespace="ml", pool="gone") is None
    assert value("kvpool_operator_pool_ready", namespace="ml", pool="kept") == 0
    metrics.keep_pools([])  # this replica leads nothing
    assert value("kvpool_operator_pool_ready", namespace="ml", pool="kept") is None
