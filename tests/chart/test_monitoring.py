"""The chart's monitoring: the operator's metrics Service and ServiceMonitor, the PrometheusRule
(checked and unit-tested with promtool) and the Grafana dashboard, which name only metrics that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from chartkit import CHART, NAMESPACE, RELEASE, find, of_kind, run_helm
from kvtest import need

MONITORING = CHART / "ci" / "monitoring-values.yaml"
DASHBOARD = CHART / "dashboards" / "kvpool.json"
METRIC = re.compile(r"\b(kvpool_[a-z0-9_]+)")


def promtool() -> str:
    found = shutil.which("promtool")
    need(found is not None, "promtool (Debian's prometheus package; scripts/bootstrap.sh --for-tests)")
    assert found is not None
    return found


def rule_groups(rendered: Callable[..., list[dict]], *sets: str) -> dict[str, Any]:
    """The PrometheusRule's spec: a Prometheus rules file."""
    return find(rendered(MONITORING, *sets), "PrometheusRule")["spec"]


def known_metrics() -> set[str]:
    """Every series name the operator serves and the sidecar exports (kvpool_sidecar.metrics)."""
    from kvpool_operator import metrics as operator
    from kvpool_sidecar import metrics as sidecar

    names = operator.names()
    declared = [
        (sidecar.STATS, sidecar.PREFIX),
        (sidecar.REDIS_STATS, sidecar.REDIS_PREFIX),
        (sidecar.MISS_RATIO_STATS, sidecar.MISS_RATIO_PREFIX),
        (sidecar.WORKING_SET_STATS, sidecar.WORKING_SET_PREFIX),
        ((sidecar.CURVE,), sidecar.MISS_RATIO_PREFIX),
    ]
    names |= {s.metric(prefix) for stats, prefix in declared for s in stats}
    return names | {sidecar.PREFIX + "ready"}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)
    ]
    return exprs


def unknown_metrics(exprs: list[str], known: set[str]) -> set[str]:
    return {name for e in exprs for name in METRIC.findall(e) if name not in known}


def test_the_operator_serves_a_metric_for_each_thing_the_issue_asks() -> None:
    known = known_metrics()
    for name in (
        "kvpool_operator_reconciles_total",
        "kvpool_operator_webhook_decisions_total",
        "kvpool_operator_webhook_duration_seconds_bucket",
        "kvpool_operator_webhook_fail_open_total",
        "kvpool_operator_sidecar_scrape_failures_total",
        "kvpool_operator_pool_shards_desired",
        "kvpool_operator_pool_shards_ready",
        "kvpool_operator_pool_ready",
    ):
        assert name in known


def test_alerts_and_dashboard_name_only_metrics_that_exist(rendered: Callable[..., list[dict]]) -> None:
    known = known_metrics()
    alerts = [r["expr"] for g in rule_groups(rendered)["groups"] for r in g["rules"]]
    dashboard = dashboard_exprs()
    assert len(alerts) >= 5 and len(dashboard) >= 15
    assert {n for e in alerts + dashboard for n in METRIC.findall(e)}, "no metric name found at all"
    assert unknown_metrics(alerts, known) == set()
    assert unknown_metrics(dashboard, known) == set()
    # the check itself: a misspelt name is caught
    assert unknown_metrics(["rate(kvpool_hit_total[5m])"], known) == {"kvpool_hit_total"}


def test_the_rules_pass_promtool_check(rendered: Callable[..., list[dict]], tmp_path: Path) -> None:
    tool = promtool()
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups(rendered)))
    result = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


# promtool test rules: series (one sample a minute) and the alerts expected at a time
ALERT_TESTS: list[dict[str, Any]] = [
    {
        "interval": "1m",
        "input_series": [
            {"series": 'kvpool_operator_pool_ready{namespace="ml",pool="llama"}', "values": "0x20"},
            {"series": 'kvpool_operator_pool_ready{namespace="ml",pool="fine"}', "values": "1x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "KvpoolPoolNotReady", "exp_alerts": []},  # for: 10m
            {
                "eval_time": "12m",
                "alertname": "KvpoolPoolNotReady",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "namespace": "ml", "pool": "llama"}}],
            },
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {"series": 'kvpool_operator_webhook_fail_open_total{reason="Error"}', "values": "0 0 1 2 2 2"},
            {"series": 'kvpool_operator_webhook_fail_open_total{reason="NotReady"}', "values": "0x5"},
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "KvpoolInjectionFailing", "exp_alerts": []},
            {
                "eval_time": "4m",
                "alertname": "KvpoolInjectionFailing",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "reason": "Error"}}],
            },
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {"series": 'kvpool_redis_ready{namespace="ml",pool="down",pod="a"}', "values": "0x10"},
            {"series": 'kvpool_redis_ready{namespace="ml",pool="down",pod="b"}', "values": "0x10"},
            # one sidecar's own trouble is not Redis down
            {"series": 'kvpool_redis_ready{namespace="ml",pool="up",pod="c"}', "values": "0x10"},
            {"series": 'kvpool_redis_ready{namespace="ml",pool="up",pod="d"}', "values": "1x10"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "7m",
                "alertname": "KvpoolRedisDown",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "namespace": "ml", "pool": "down"}}],
            },
        ],
    },
    {
        # six hours at 90% hits, then half an hour at 10%, 100 lookups a minute throughout
        "interval": "1m",
        "input_series": [
            {
                "series": 'kvpool_hits_total{namespace="ml",pool="llama",pod="a"}',
                "values": "0+90x360 32410+10x30",
            },
            {
                "series": 'kvpool_misses_total{namespace="ml",pool="llama",pod="a"}',
                "values": "0+10x360 3690+90x30",
            },
        ],
        "alert_rule_test": [
            {"eval_time": "350m", "alertname": "KvpoolHitRateCollapse", "exp_alerts": []},
            {
                "eval_time": "390m",
                "alertname": "KvpoolHitRateCollapse",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "namespace": "ml", "pool": "llama"}}],
            },
        ],
    },
]


def test_the_alerts_fire_when_they_should(rendered: Callable[..., list[dict]], tmp_path: Path) -> None:
    tool = promtool()
    groups = rule_groups(rendered)
    for group in groups["groups"]:  # promtool compares annotations too: these tests are about when
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": ALERT_TESTS}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [tool, "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_monitoring_objects_only_where_the_cluster_has_the_kinds() -> None:
    plain = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", str(MONITORING)]
    without = run_helm(*plain)
    assert without.returncode == 0, without.stderr
    assert "kind: ServiceMonitor" not in without.stdout and "kind: PrometheusRule" not in without.stdout
    for kind in ("ServiceMonitor", "PrometheusRule"):
        have = run_helm(*plain, "--api-versions", f"monitoring.coreos.com/v1/{kind}")
        assert f"kind: {kind}" in have.stdout


def test_the_service_monitor_scrapes_every_operator_replica(rendered: Callable[..., list[dict]]) -> None:
    from kvpool_operator.cli import parser

    objects = rendered(MONITORING)
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service", f"{RELEASE}-kvpool-metrics")
    pod = find(objects, "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # the webhook's Service is not scraped
    webhook = find(objects, "Service", f"{RELEASE}-kvpool-webhook")
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= webhook["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["publishNotReadyAddresses"] is True  # a replica not yet ready has numbers too
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] and endpoint["honorLabels"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == 8082
    args = parser().parse_args(container["args"])
    assert args.metrics == f"http://0.0.0.0:{ports['metrics']}{endpoint['path']}"


def test_metrics_port_zero_serves_none(rendered: Callable[..., list[dict]]) -> None:
    from kvpool_operator.cli import parser

    objects = rendered(MONITORING, "metrics.port=0")
    (container,) = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert parser().parse_args(container["args"]).metrics == ""
    assert "metrics" not in {p["name"] for p in container["ports"]}
    assert not [o for o in of_kind(objects, "Service") if o["metadata"]["name"].endswith("-metrics")]
    assert not of_kind(objects, "ServiceMonitor")
    rules = [r.get("alert") for g in rule_groups(rendered, "metrics.port=0")["groups"] for r in g["rules"]]
    assert "KvpoolOperatorDown" not in rules  # nothing would be scraped: it would always fire


def test_the_dashboard_ships_in_a_config_map_grafana_loads(rendered: Callable[..., list[dict]]) -> None:
    assert not [
        o
        for o in of_kind(rendered(None), "ConfigMap")
        if "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
    (config_map,) = [
        o for o in of_kind(rendered(MONITORING), "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")
    ]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "kvpool"}
    dashboard = json.loads(config_map["data"]["kvpool.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvpool" and dashboard["panels"]
    other = [o for o in of_kind(rendered(MONITORING, "grafanaDashboard.namespace=monitoring"), "ConfigMap")]
    assert "monitoring" in {o["metadata"]["namespace"] for o in other}
