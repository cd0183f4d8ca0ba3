"""Which container the webhook configures, which pods it leaves alone (and why), and the sidecar's
resources: the pure decisions. The API-server tier (tests/k8s) shows the server admits what comes out."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvpool_operator.injection import decide
from kvpool_operator.pods import sidecar_stuck
from kvpool_operator.pool import parse_pool, problems
from kvpool_operator.resources import guaranteed, resource_problems, sidecar_resources
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.vllm_target import Skip, target_container

OURS = '{"kv_connector":"KVPoolConnector","kv_connector_module_path":"kvpool_connector"}'


def pod(*containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": "vllm"}}, "spec": {"containers": list(containers), **spec}}


def c(name: str, image: str = "busybox", **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": image, **fields}


@pytest.mark.parametrize(
    ("containers", "expected"),
    [
        ([c("proxy", "envoy"), c("engine", command=["vllm", "serve"], args=["m"])], 1),
        ([c("proxy", "envoy"), c("engine", "vllm/vllm-openai:v0.33.0", args=["--model", "m"])], 1),
        ([c("a", command=["python3", "-m", "vllm.entrypoints.openai.api_server"])], 0),
        ([c("a", command=["/usr/local/bin/vllm", "serve", "m"])], 0),
        ([c("a", command=["sh", "-c", 'exec vllm serve m "$@"', "vllm"], args=["--port", "8000"])], 0),
        ([c("a", command=["sh", "-c"], args=['exec vllm serve m "$@"', "vllm"])], 0),
        ([c("a", command=["vllm", "serve"], args=["m", "--kv-transfer-config", OURS])], 0),  # re-injection
        ([c("proxy", "envoy"), c("web", "nginx")], "NoVLLMContainer"),
        ([c("a", command=["vllm", "serve"]), c("b", "vllm/vllm-openai")], "SeveralVLLMContainers"),
        ([c("a", command=["sh", "-c", "vllm serve m"])], "StartedThroughShell"),  # the flag would be $0
        ([c("a", command=["sh", "-c", 'vllm serve m "$@"'])], "StartedThroughShell"),  # still $0
        ([c("a", command=["bash", "-lc", "vllm serve m --port 8000"], args=["x"])], "StartedThroughShell"),
        ([c("a", command=["vllm", "serve"], args=["--kv-transfer-config", '{"kv_connector":"LMCache"}'])],
         "OwnConnector"),
        ([c("a", command=["vllm", "serve", '--kv_transfer_config={"kv_connector":"Nixl"}'])], "OwnConnector"),
        ([c("a", command=["vllm", "serve", "--kv-transfer-config", "not json"])], "OwnConnector"),
        ([c("a", command=["vllm", "serve"], args=["--kv-transfer-config.kv_connector", "Nixl"])],
         "OwnConnector"),
        ([c("a", command=["vllm", "serve", "--kv_transfer_config.kv_role=kv_both"])], "OwnConnector"),
        ([c("a", command=["bash", "-c", "exec vllm serve m --kv-transfer-config '{}' \"$@\"", "vllm"])],
         "OwnConnector"),
        ([c("a", command=["sh", "-c", 'KV_TRANSFER_CONFIG=x exec vllm serve m "$@"', "vllm"])],
         "OwnConnector"),
        ([c("a", command=["vllm", "serve", "--kv-cache-dtype", "fp8", "--kv", "x"])], 0),  # not the flag
    ],
    ids=["by-command-after-a-proxy", "by-image-after-a-proxy", "module", "path", "sh-passes-args",
         "sh-script-in-args", "our-own-flag", "none", "two", "sh-no-args", "sh-no-dollar0", "bash-lc",
         "users-connector", "users-connector-underscore", "users-garbage", "dotted", "dotted-underscores",
         "in-a-script", "script-any-spelling", "other-kv-flags"],
)  # fmt: skip
def test_the_target_container_is_found_by_what_it_runs(containers: list, expected: int | str) -> None:
    found = target_container(pod(*containers), None)
    assert (found.reason if isinstance(found, Skip) else found) == expected


def test_a_named_container_wins_and_a_missing_one_is_a_reason() -> None:
    p = pod(c("proxy", command=["vllm-proxy"]), c("engine", "my/engine", command=["python", "serve.py"]))
    assert target_container(p, "engine") == 1
    missing = target_container(p, "vllm")
    assert isinstance(missing, Skip) and missing.reason == "ContainerNotFound"
    script = pod(c("engine", command=["bash", "/start-vllm.sh"]))  # what the script does is unseen
    skip = target_container(script, "engine")
    assert isinstance(skip, Skip) and skip.reason == "StartedThroughShell"


def _pool(**spec: Any):
    return parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi", **spec})


def test_a_skipped_pod_is_annotated_and_otherwise_untouched() -> None:
    p = pod(c("a", command=["sh", "-c", "vllm serve m"]))
    decision = decide(p, "ns", [_pool()], OperatorSettings())
    assert decision.pod is not None
    reason = decision.pod["metadata"]["annotations"].pop("kvpool.dev/skipped")
    assert reason.startswith("StartedThroughShell: container a starts vllm through a shell")
    del decision.pod["metadata"]["annotations"]
    assert decision.pod == p and decision.warnings and "through a shell" in decision.warnings[0]


def test_host_network_pods_are_refused_with_a_reason() -> None:
    p = pod(c("a", command=["vllm", "serve"]), hostNetwork=True)
    decision = decide(p, "ns", [_pool()], OperatorSettings())
    assert decision.pod is not None
    assert decision.pod["metadata"]["annotations"]["kvpool.dev/skipped"].startswith("HostNetwork:")
    assert "initContainers" not in decision.pod["spec"]


def test_injecting_a_pod_skipped_before_drops_the_reason() -> None:
    p = pod(c("a", command=["vllm", "serve"]))
    p["metadata"]["annotations"] = {"kvpool.dev/skipped": "SeveralPools: ..."}
    injected = decide(p, "ns", [_pool()], OperatorSettings()).pod
    assert injected is not None and "kvpool.dev/skipped" not in injected["metadata"]["annotations"]
    args = injected["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector"] == "KVPoolConnector"


# --- resources ---------------------------------------------------------------------------------------


def test_default_requests_never_exceed_given_limits() -> None:
    r = sidecar_resources(2**30, {"limits": {"cpu": "100m", "memory": "2Gi"}})
    assert r == {"requests": {"cpu": "100m", "memory": "1355Mi"}, "limits": {"cpu": "100m", "memory": "2Gi"}}


def test_a_guaranteed_pod_gets_a_guaranteed_sidecar() -> None:
    r = sidecar_resources(2**30, None, guaranteed=True)
    assert r["requests"] == r["limits"] == {"cpu": "250m", "memory": "1355Mi"}
    r = sidecar_resources(2**30, {"limits": {"cpu": "1", "memory": "2Gi"}}, guaranteed=True)
    assert r["requests"] == r["limits"] == {"cpu": "1", "memory": "2Gi"}


@pytest.mark.parametrize(
    ("resources", "qos"),
    [
        ({"limits": {"cpu": "2", "memory": "4Gi"}}, True),  # requests default to limits
        ({"limits": {"cpu": "2", "memory": "4Gi"}, "requests": {"cpu": "2000m", "memory": "4Gi"}}, True),
        ({"limits": {"cpu": "2", "memory": "4Gi"}, "requests": {"cpu": "1"}}, False),
        ({"limits": {"memory": "4Gi"}}, False),
        ({}, False),
    ],
)
def test_guaranteed_is_judged_as_the_api_server_does(resources: dict, qos: bool) -> None:
    assert guaranteed(pod(c("a", resources=resources))) is qos


def test_decide_keeps_a_guaranteed_pod_guaranteed() -> None:
    res = {"limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}}
    injected = decide(
        pod(c("a", command=["vllm", "serve"], resources=res)), "ns", [_pool()], OperatorSettings()
    ).pod
    assert injected is not None
    assert guaranteed(injected)


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ({"requests": {"memory": "8Gi"}}, "requests.memory 8Gi is above its limit"),
        ({"limits": {"memory": "1Gi"}}, "is less than the arena plus the sidecar process (1355Mi)"),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}, "requests.cpu 2 is above its limit 1"),
        ({"limits": {"cpu": "lots"}}, "'lots' is not a quantity"),
    ],
)
def test_resources_the_api_server_or_the_kernel_would_refuse_are_pool_problems(
    given: dict, fragment: str
) -> None:
    assert any(fragment in p for p in resource_problems(2**30, given))
    assert any(fragment in p for p in problems(_pool(sidecar={"resources": given})))


def test_the_pools_pull_secrets_join_the_pods_own_once() -> None:
    pool = _pool(sidecar={"imagePullSecrets": [{"name": "kvpool-registry"}, {"name": "team"}]})
    p = pod(c("a", command=["vllm", "serve"]), imagePullSecrets=[{"name": "team"}])
    once = decide(p, "ns", [pool], OperatorSettings()).pod
    assert once is not None
    assert once["spec"]["imagePullSecrets"] == [{"name": "team"}, {"name": "kvpool-registry"}]
    twice = decide(once, "ns", [pool], OperatorSettings()).pod
    assert twice is not None and twice["spec"]["imagePullSecrets"] == once["spec"]["imagePullSecrets"]
    plain = decide(pod(c("a", command=["vllm", "serve"])), "ns", [_pool()], OperatorSettings()).pod
    assert plain is not None and "imagePullSecrets" not in plain["spec"]


def test_an_open_sidecar_breaker_admits_new_pods_without_the_cache() -> None:
    pool = dataclasses.replace(_pool(), sidecar_not_starting="ImagePullBackOff: Back-off pulling image")
    decision = decide(pod(c("a", command=["vllm", "serve"])), "ns", [pool], OperatorSettings())
    assert decision.pod is not None and "initContainers" not in decision.pod["spec"]
    assert decision.pod["metadata"]["annotations"]["kvpool.dev/skipped"].startswith("SidecarNotStarting: ")


@pytest.mark.parametrize(
    ("state", "stuck"),
    [
        ({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off"}}, "ImagePullBackOff: Back-off"),
        ({"waiting": {"reason": "CrashLoopBackOff"}}, "CrashLoopBackOff"),
        ({"waiting": {"reason": "ContainerCreating"}}, None),  # on its way
        ({"running": {}}, None),
    ],
)
def test_a_stuck_sidecar_is_read_from_the_kubelets_status(state: dict, stuck: str | None) -> None:
    p = {"status": {"initContainerStatuses": [{"name": "kvpool-sidecar", "state": state}]}}
    assert sidecar_stuck(p) == stuck
