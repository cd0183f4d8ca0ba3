"""The pod-mutating webhook, served by kopf's real WebhookServer inside the running operator,
answering real AdmissionReview requests; the returned JSON patches are applied and the whole pod
compared with the expected one."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubeharness.emulator import Cluster, wait_indexed
from kubeharness.objects import pool_manifest, pool_path
from kubeharness.webhooks import admitted, review, take_skip_reason
from kvtest import wait_until
from podchecks import sidecar_of

from kvpool_operator.injected_parts import digest
from kvpool_operator.injection import decide, remove_injection
from kvpool_operator.pool import parse_pool
from kvpool_operator.settings import OperatorSettings
from kvpool_sidecar.settings import parse_settings

NS = "web"


def make_pool(cluster: Cluster, name: str, spec: dict[str, Any], namespace: str = NS) -> None:
    cluster.api.create(pool_path(namespace), pool_manifest(namespace, name, spec))
    wait_until(
        lambda: (cluster.api.get(pool_path(namespace, name)) or {}).get("status", {}).get("connectorConfig"),
        30,
        f"pool {name} reconciled",
    )
    wait_indexed(cluster, namespace)


@pytest.fixture(scope="module")
def pools(cluster: Cluster) -> Iterator[Cluster]:
    make_pool(
        cluster,
        "solo",
        {
            "selector": {"matchLabels": {"app": "solo"}},
            "capacity": "1Gi",
            "chunkSize": 128,
            "priorityLimit": 2,
        },
    )
    make_pool(
        cluster,
        "cached",
        {
            "selector": {"matchLabels": {"app": "cached"}},
            "capacity": "2Gi",
            "backend": "redis",
            "redis": {"mode": "shared", "replicas": 2, "prewarm": "4Gi"},
            "vllmContainer": "engine",
            "sidecar": {"port": 8000},
        },
    )
    make_pool(cluster, "team-a", {"selector": {"matchLabels": {"team": "x"}}})
    make_pool(
        cluster,
        "team-b",
        {"selector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["x", "y"]}]}},
    )
    yield cluster
    for name in ("solo", "cached", "team-a", "team-b"):
        cluster.api.delete(pool_path(NS, name))


def vllm_pod(labels: dict[str, str], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "vllm-", "labels": labels, **meta},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "args": ["--model", "Qwen/Qwen3-0.6B"],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


SOLO_CONFIG = (
    '{"kv_connector":"KVPoolConnector","kv_connector_extra_config":{"chunk_size":128,'
    '"discard_partial_chunks":false,"pool":"web/solo","priority_limit":2,"save_decode_cache":false,'
    '"shm_path":"/var/run/kvpool","sidecar_url":"http://127.0.0.1:7070","skip_last_n_tokens":0},'
    '"kv_connector_module_path":"kvpool_connector","kv_load_failure_policy":"recompute","kv_role":"kv_both"}'
)


def probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": 7071},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


RESTRICTED = {
    "runAsNonRoot": True,  # the uid: the image's, or the one the platform assigns
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
EXPECTED_SOLO: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "generateName": "vllm-",
        "labels": {"app": "solo", "kvpool.dev/pool": "solo"},
        "annotations": {
            "kvpool.dev/config-hash": "",  # below: a digest of all that was added
            "kvpool.dev/status-port": "7071",
        },
    },
    "spec": {
        "containers": [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.33.0",
                "args": ["--model", "Qwen/Qwen3-0.6B", "--kv-transfer-config", SOLO_CONFIG],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [
                    {"name": "kvpool-arena", "mountPath": "/var/run/kvpool"},
                    {"name": "kvpool-connector", "mountPath": "/opt/kvpool-connector", "readOnly": True},
                ],
                "env": [{"name": "PYTHONPATH", "value": "/opt/kvpool-connector"}],  # the payload first
            }
        ],
        "initContainers": [
            {  # the connector payload, from the sidecar's image: a stock vLLM image needs nothing more
                "name": "kvpool-connector",
                "image": "kvpool/sidecar:test",
                "command": ["cp", "-R", "/opt/kvpool-connector/.", "/mnt/kvpool-connector"],
                "volumeMounts": [{"name": "kvpool-connector", "mountPath": "/mnt/kvpool-connector"}],
                "resources": {
                    "requests": {"cpu": "50m", "memory": "64Mi"},
                    "limits": {"cpu": "50m", "memory": "64Mi"},
                },
                "securityContext": RESTRICTED,
            },
            {
                "name": "kvpool-sidecar",
                "image": "kvpool/sidecar:test",
                "restartPolicy": "Always",
                "args": [
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "7070",
                    "--status-port",
                    "7071",
                    "--capacity",
                    "1073741824",
                    "--arena-dir",
                    "/var/run/kvpool",
                    "--shared-group",
                    "--keep-arena",
                ],
                "ports": [{"name": "kvpool-status", "containerPort": 7071, "protocol": "TCP"}],
                "volumeMounts": [{"name": "kvpool-arena", "mountPath": "/var/run/kvpool"}],
                "resources": {
                    "requests": {"cpu": "250m", "memory": "1355Mi"},
                    "limits": {"memory": "1355Mi"},
                },
                "livenessProbe": probe("/healthz", 10, 6),
                "securityContext": {**RESTRICTED, "runAsGroup": 65532},
            },
        ],
        "volumes": [
            {"name": "kvpool-arena", "emptyDir": {"medium": "Memory", "sizeLimit": "1030Mi"}},
            {"name": "kvpool-connector", "emptyDir": {"sizeLimit": "64Mi"}},
        ],
        "securityContext": {"supplementalGroups": [65532]},  # the arena's group, for vLLM too
    },
}
EXPECTED_SOLO["metadata"]["annotations"]["kvpool.dev/config-hash"] = digest(
    remove_injection(EXPECTED_SOLO), EXPECTED_SOLO
)


def test_matched_pod_gets_native_sidecar_and_config(pools: Cluster) -> None:
    pod, response = admitted(pools.webhook_url, vllm_pod({"app": "solo"}), NS)
    assert pod == EXPECTED_SOLO
    assert "warnings" not in response


def test_injection_is_idempotent(pools: Cluster) -> None:
    once, _ = admitted(pools.webhook_url, vllm_pod({"app": "solo"}), NS)
    twice, response = admitted(pools.webhook_url, once, NS)
    assert twice == once == EXPECTED_SOLO
    assert "patch" not in response


def test_a_users_own_connector_is_never_replaced(pools: Cluster) -> None:
    pod = vllm_pod({"app": "solo"})
    pod["spec"]["containers"][0]["args"] = [
        "--kv-transfer-config",
        '{"kv_connector":"Other"}',
        "--model",
        "Qwen/Qwen3-0.6B",
    ]
    result, response = admitted(pools.webhook_url, pod, NS)
    reason = take_skip_reason(result)
    assert result == pod  # untouched but for the reason
    assert reason.startswith("OwnConnector: container vllm already sets --kv-transfer-config")
    assert "'Other'" in reason and any("'Other'" in w for w in response["warnings"])


@pytest.mark.parametrize(
    ("labels", "meta", "namespace"),
    [
        ({"app": "other"}, {}, NS),  # matched by no pool
        ({"app": "solo"}, {"annotations": {"kvpool.dev/inject": "false"}}, NS),  # opted out
        ({"app": "solo"}, {}, "elsewhere"),  # the pool is in another namespace
    ],
    ids=["unmatched", "opted-out", "other-namespace"],
)
def test_pods_not_asked_for_are_untouched(pools: Cluster, labels: dict, meta: dict, namespace: str) -> None:
    pod = vllm_pod(labels, **meta)
    reads = limit_reads(pools, namespace)
    result, response = admitted(pools.webhook_url, pod, namespace)
    assert result == pod
    assert "patch" not in response and "warnings" not in response
    # every pod of a namespace passes the webhook: one no pool claims costs it no API call
    assert limit_reads(pools, namespace) == reads


def limit_reads(cluster: Cluster, namespace: str) -> int:
    """How many times the operator listed the namespace's LimitRanges or ResourceQuotas so far."""
    paths = {f"/api/v1/namespaces/{namespace}/{kind}" for kind in ("limitranges", "resourcequotas")}
    return sum(path in paths for _, path, _, _ in cluster.api.requests())


def test_pod_matched_by_two_pools_is_untouched_with_warning_events(pools: Cluster) -> None:
    pod = vllm_pod({"team": "x"})
    result, response = admitted(pools.webhook_url, pod, NS)
    assert take_skip_reason(result).startswith("SeveralPools:")
    assert result == pod
    assert any("team-a, team-b" in w for w in response["warnings"])
    for name in ("team-a", "team-b"):
        wait_until(
            lambda name=name: any(
                e["type"] == "Warning" and e["reason"] == "PodNotInjected" for e in pools.api.events(NS, name)
            ),
            30,
            f"a warning event on {name}",
        )


def test_shared_redis_pod_gets_shard_list_and_password(pools: Cluster) -> None:
    pod = vllm_pod({"app": "cached"})
    pod["spec"]["containers"].insert(0, {"name": "proxy", "image": "envoy"})
    pod["spec"]["containers"][1]["name"] = "engine"
    result, _ = admitted(pools.webhook_url, pod, NS)
    proxy, engine = result["spec"]["containers"]
    assert proxy == {"name": "proxy", "image": "envoy"}  # vllmContainer picks the engine, not the first
    config = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["sidecar_url"] == "http://127.0.0.1:8000"
    sidecar = sidecar_of(result)
    assert sidecar["args"][-9:] == [
        "--redis-urls-file",
        "/etc/kvpool/redis/redis-urls",
        "--pool-key-required",
        "--pool-key-file",
        "/etc/kvpool/credentials/pool-key",
        "--redis-password-file",
        "/etc/kvpool/credentials/redis-password",
        "--prewarm-bytes",
        str(2 * 2**30),  # spec.redis.prewarm 4Gi, at most the 2Gi CPU tier
    ]
    assert sidecar["args"][sidecar["args"].index("--status-port") + 1] == "8001"
    assert "env" not in sidecar  # files, which the kubelet keeps current when a Secret is made again
    credentials = {"name": "kvpool-credentials", "mountPath": "/etc/kvpool/credentials", "readOnly": True}
    assert credentials in sidecar["volumeMounts"]
    assert {
        "name": "kvpool-credentials",
        "projected": {
            "sources": [
                {"secret": {"name": "cached-kvpool-key", "optional": True,
                            "items": [{"key": "pool-key", "path": "pool-key"}]}},
                {"secret": {"name": "cached-kvpool-redis", "optional": True,
                            "items": [{"key": "password", "path": "redis-password"}]}},
            ]
        },
    } in result["spec"]["volumes"]  # fmt: skip
    assert {"name": "kvpool-redis-urls", "mountPath": "/etc/kvpool/redis", "readOnly": True} in sidecar[
        "volumeMounts"
    ]
    assert {
        "name": "kvpool-redis-urls",
        "configMap": {
            "name": "cached-kvpool",
            "optional": True,
            "items": [{"key": "redis-urls", "path": "redis-urls"}],
        },
    } in result["spec"]["volumes"]
    assert "startupProbe" not in sidecar  # vLLM never waits on its cache


def test_injected_pods_need_no_privileges(pools: Cluster) -> None:
    for labels in ({"app": "solo"}, {"app": "cached"}):
        pod = vllm_pod(labels)
        if labels["app"] == "cached":
            pod["spec"]["containers"][0]["name"] = "engine"
        result, _ = admitted(pools.webhook_url, pod, NS)
        text = json.dumps(result)
        for forbidden in (
            "privileged",
            "hostIPC",
            "hostPID",
            "hostNetwork",
            "hostPath",
            "SYS_ADMIN",
            "IPC_LOCK",
        ):
            assert forbidden not in text


def test_webhook_fails_open_on_a_malformed_pod(pools: Cluster) -> None:
    pod = vllm_pod({"app": "solo"})
    pod["metadata"]["labels"] = ["not", "a", "map"]
    response = review(pools.webhook_url, pod, NS)
    assert response["allowed"] is True and "patch" not in response


def test_dry_run_posts_no_events(pools: Cluster) -> None:
    def skips() -> int:  # every skipped pod, counted on the events of its (reason, owner)
        return sum(e.get("count", 1) for e in pools.api.events(NS, "team-a"))

    before = skips()
    response = review(pools.webhook_url, vllm_pod({"team": "x"}), NS, dry_run=True)
    assert response["allowed"] is True and response["warnings"]
    # a later real admission's count shows the dry run's would have been counted by now
    admitted(pools.webhook_url, vllm_pod({"team": "x"}), NS)
    wait_until(lambda: skips() >= before + 1, 30, "the real admission's count")
    assert skips() == before + 1


def test_legacy_mode_adds_a_plain_container() -> None:
    pool = parse_pool(
        NS,
        "solo",
        {
            "selector": {"matchLabels": {"app": "solo"}},
            "capacity": "1Gi",
            "chunkSize": 128,
            "priorityLimit": 2,
        },
    )
    decision = decide(
        vllm_pod({"app": "solo"}),
        NS,
        [pool],
        OperatorSettings(sidecar_image="kvpool/sidecar:test", legacy_sidecar=True),
    )
    expected = copy.deepcopy(EXPECTED_SOLO)
    payload, sidecar = expected["spec"]["initContainers"]
    expected["spec"]["initContainers"] = [payload]  # the payload is still copied before vLLM starts
    del sidecar["restartPolicy"]
    expected["spec"]["containers"].append(sidecar)
    annotations = expected["metadata"]["annotations"]  # what was added differs: so does its digest
    annotations["kvpool.dev/config-hash"] = digest(remove_injection(expected), expected)
    assert decision.pod == expected
    assert (
        decide(
            decision.pod,
            NS,
            [pool],
            OperatorSettings(sidecar_image="kvpool/sidecar:test", legacy_sidecar=True),
        ).pod
        == expected
    )


@pytest.mark.parametrize("backend", ["cpu", "redis"])
def test_the_sidecar_parses_what_the_webhook_injects(backend: str) -> None:
    """The injected args and env, read by the sidecar's own settings parser."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "solo"}},
        "capacity": "1.5Gi",
        "sidecar": {"port": 9100},
    }
    if backend == "redis":
        spec.update(backend="redis", redis={"mode": "shared"})
    pool = parse_pool(NS, "solo", spec)
    pod = decide(vllm_pod({"app": "solo"}), NS, [pool], OperatorSettings()).pod
    assert pod is not None
    sidecar = sidecar_of(pod)
    settings = parse_settings(sidecar["args"], environ={})
    assert (settings.host, settings.port, settings.status_port) == ("127.0.0.1", 9100, 9101)
    assert settings.capacity == int(1.5 * 2**30)
    assert str(settings.arena_dir) == "/var/run/kvpool" and settings.shared_group
    # the arena's group: the sidecar runs with it and every container of the pod has it
    assert sidecar["securityContext"]["runAsGroup"] == 65532
    assert pod["spec"]["securityContext"]["supplementalGroups"] == [65532]
    if backend == "redis":
        assert str(settings.redis_urls_file) == "/etc/kvpool/redis/redis-urls"
        assert str(settings.redis_password_file) == "/etc/kvpool/credentials/redis-password"
        assert str(settings.pool_key_file) == "/etc/kvpool/credentials/pool-key"
        assert settings.pool_key_required
    else:
        assert settings.redis_urls_file is None and settings.redis_password_file is None
        assert settings.pool_key_file is None and not settings.pool_key_required


def test_the_arena_group_joins_the_pods_own_groups_once() -> None:
    pool = parse_pool(NS, "solo", {"selector": {"matchLabels": {"app": "solo"}}})
    pod = vllm_pod({"app": "solo"})
    pod["spec"]["securityContext"] = {"runAsUser": 1000, "fsGroup": 2000, "supplementalGroups": [5]}
    once = decide(pod, NS, [pool], OperatorSettings()).pod
    assert once is not None
    assert once["spec"]["securityContext"] == {
        "runAsUser": 1000,
        "fsGroup": 2000,
        "supplementalGroups": [5, 65532],
    }
    twice = decide(once, NS, [pool], OperatorSettings()).pod
    assert twice is not None and twice["spec"]["securityContext"] == once["spec"]["securityContext"]


@pytest.mark.parametrize("redis", [{"mode": "shared"}, {"mode": "external", "url": "redis://r:6379"}])
def test_a_redis_pool_injects_a_pod_again_to_the_same_pod(redis: dict[str, Any]) -> None:
    """The API server calls the webhook again (reinvocationPolicy IfNeeded): every volume kvpool adds,
    the credentials' included, is replaced, not added twice (a duplicate volume gets the pod refused)."""
    pool = parse_pool(
        NS, "solo", {"selector": {"matchLabels": {"app": "solo"}}, "backend": "redis", "redis": redis}
    )
    once = decide(vllm_pod({"app": "solo"}), NS, [pool], OperatorSettings()).pod
    assert once is not None
    assert decide(once, NS, [pool], OperatorSettings()).pod == once
