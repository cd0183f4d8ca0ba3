"""A vLLM `--config` file: where it comes from (mounts, subPath, items), what the webhook reads, and
what a pod gets for each answer, bad input included (never an exception, never a broken pod)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from kvpool_operator import webhook
from kvpool_operator.config_file import ConfigMapKey, Unreadable, config_maps_to_read, source
from kvpool_operator.injection import decide
from kvpool_operator.kube import ApiError
from kvpool_operator.pool import parse_pool
from kvpool_operator.settings import OperatorSettings

NIXL_YAML = "kv-transfer-config: {kv_connector: NixlConnector, kv_role: kv_both}\n"


def vllm(*args: str, **fields: Any) -> dict[str, Any]:
    return {"name": "vllm", "image": "vllm/vllm-openai", "command": ["vllm", "serve", "/m", *args], **fields}


def pod(container: dict[str, Any], *volumes: dict[str, Any], **annotations: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"app": "vllm"}}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {"containers": [container], "volumes": list(volumes)}}


def cm_volume(name: str = "cfg", config_map: str = "vllm-config", **fields: Any) -> dict[str, Any]:
    return {"name": name, "configMap": {"name": config_map, **fields}}


ETC_VLLM = {"name": "cfg", "mountPath": "/etc/vllm"}
MOUNTED = vllm("--config", "/etc/vllm/config.yaml", volumeMounts=[ETC_VLLM])


def outcome(p: dict[str, Any], config_maps: dict[str, Any]) -> str:
    """ "injected", or the skip reason."""
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"})
    decision = decide(p, "ns", [pool], OperatorSettings(), None, config_maps)
    assert decision.pod is not None
    skipped = decision.pod["metadata"].get("annotations", {}).get("kvpool.dev/skipped")
    if skipped is None:
        return "injected"
    assert decision.skip is not None and skipped == f"{decision.skip.reason}: {decision.skip.message}"
    return decision.skip.reason


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (NIXL_YAML, "OwnConnector"),
        ("kv_transfer_config:\n  kv_connector: NixlConnector\n", "OwnConnector"),
        ("kv-transfer-config.kv_connector: NixlConnector\n", "OwnConnector"),
        ("max-model-len: 128\nport: 8001\n", "injected"),  # the CLI flag wins over the file in vLLM
        ("port: [8001\n", "ConfigFileInvalid"),  # not YAML
        ("- a list\n", "ConfigFileInvalid"),  # YAML, not a mapping: vLLM fails on it too
        ("", "ConfigFileInvalid"),
    ],
    ids=["dashes", "underscores", "dotted", "no-connector", "not-yaml", "a-list", "empty"],
)
def test_a_config_map_file_is_read_for_a_connector(text: str, expected: str) -> None:
    p = pod(MOUNTED, cm_volume())
    assert outcome(p, {"vllm-config": {"data": {"config.yaml": text}}}) == expected


def test_a_config_file_kvpool_cannot_read_skips_the_pod_unless_the_pod_vouches() -> None:
    baked = vllm("--config=/opt/serve.yaml")  # the image's own file
    from_secret = vllm("--config", "/etc/s/c.yaml", volumeMounts=[{"name": "s", "mountPath": "/etc/s"}])
    secret = {"name": "s", "secret": {"secretName": "vllm"}}
    missing = Unreadable("no ConfigMap vllm-config in namespace ns")
    no_key = {"vllm-config": {"data": {"other": "x"}}}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (pod(baked), {}),
        (pod(from_secret, secret), {}),
        (pod(MOUNTED, cm_volume()), {"vllm-config": missing}),
        (pod(MOUNTED, cm_volume()), no_key),
    ]
    for p, read in cases:
        assert outcome(p, read) == "ConfigFileUnread"
        p["metadata"]["annotations"] = {"kvpool.dev/config-has-no-connector": "true"}
        assert outcome(p, read) == "injected"
    # vouching covers only what kvpool cannot read: a file it reads still decides
    vouched = pod(MOUNTED, cm_volume(), **{"kvpool.dev/config-has-no-connector": "true"})
    assert outcome(vouched, {"vllm-config": {"data": {"config.yaml": NIXL_YAML}}}) == "OwnConnector"


def test_the_unread_reason_says_where_the_file_comes_from_and_what_to_do() -> None:
    p = pod(vllm("--config", "/etc/s/c.yaml", volumeMounts=[{"name": "s", "mountPath": "/etc/s"}]),
            {"name": "s", "secret": {"secretName": "vllm"}})  # fmt: skip
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"})
    skip = decide(p, "ns", [pool], OperatorSettings(), None, {}).skip
    assert skip is not None and "secret volume" in skip.message
    assert 'kvpool.dev/config-has-no-connector: "true"' in skip.message


@pytest.mark.parametrize(
    ("container", "volume", "expected"),
    [
        (MOUNTED, cm_volume(), ConfigMapKey("vllm-config", "config.yaml")),
        (  # items remap keys to paths: the file is the item whose path it is
            vllm("--config", "/etc/vllm/serve/c.yaml", volumeMounts=[ETC_VLLM]),
            cm_volume(items=[{"key": "o", "path": "o.yaml"}, {"key": "vllm.yaml", "path": "serve/c.yaml"}]),
            ConfigMapKey("vllm-config", "vllm.yaml"),
        ),
        (  # a subPath mount: the file is the key the subPath names
            vllm("--config", "/etc/config.yaml",
                 volumeMounts=[{"name": "cfg", "mountPath": "/etc/config.yaml", "subPath": "vllm.yaml"}]),
            cm_volume(),
            ConfigMapKey("vllm-config", "vllm.yaml"),
        ),
        (  # the deepest mount holds it; a relative path is the working directory's
            vllm("--config", "conf/c.yaml", workingDir="/srv",
                 volumeMounts=[{"name": "root", "mountPath": "/srv"},
                               {**ETC_VLLM, "mountPath": "/srv/conf"}]),
            cm_volume(),
            ConfigMapKey("vllm-config", "c.yaml"),
        ),
        (vllm("--config", "conf/c.yaml"), cm_volume(), "working directory"),
        (MOUNTED, {"name": "cfg", "emptyDir": {}}, "emptyDir volume"),
        (vllm("--config", "/etc/vllm/x/c.yaml", volumeMounts=[{"name": "cfg", "mountPath": "/etc/vllm"}]),
         cm_volume(), "not a key"),
        (vllm("--config", "/etc/vllm/c.yaml", volumeMounts=[{"name": "cfg", "mountPath": "/etc/vllm"}]),
         cm_volume(items=[{"key": "a", "path": "a.yaml"}]), "no item"),
    ],
    ids=["plain", "items", "sub-path", "deepest-relative", "relative-unknown", "empty-dir", "nested",
         "no-item"],
)  # fmt: skip
def test_a_config_file_is_traced_to_its_config_map_key(
    container: dict[str, Any], volume: dict[str, Any], expected: ConfigMapKey | str
) -> None:
    p = pod(container, volume, {"name": "root", "emptyDir": {}})
    found = source(p, container, (container["command"] + [""])[container["command"].index("--config") + 1])
    if isinstance(expected, ConfigMapKey):
        assert found == expected
        assert config_maps_to_read(p) == {expected.name}
    else:
        assert isinstance(found, Unreadable) and expected in found.why
        assert config_maps_to_read(p) == set()


def test_binary_data_and_a_script_s_config_are_read() -> None:
    script = {"name": "vllm", "image": "vllm/vllm-openai", "command": ["sh", "-c"],
              "args": ['exec vllm serve /m --config "/etc/vllm/config.yaml" "$@"', "vllm"],
              "volumeMounts": [{"name": "cfg", "mountPath": "/etc/vllm"}]}  # fmt: skip
    p = pod(script, cm_volume())
    assert config_maps_to_read(p) == {"vllm-config"}
    binary = {"binaryData": {"config.yaml": base64.b64encode(NIXL_YAML.encode()).decode()}}
    assert outcome(p, {"vllm-config": binary}) == "OwnConnector"
    assert outcome(
        p, {"vllm-config": {"binaryData": {"config.yaml": base64.b64encode(b"\xff").decode()}}}
    ) == ("ConfigFileUnread")
    variable = dict(script, args=['exec vllm serve /m --config "$CONFIG" "$@"', "vllm"])
    assert outcome(pod(variable, cm_volume()), {}) == "ConfigFileUnread"


class FakeKube:
    """kube.get's answers: a ConfigMap, None (404), or an exception."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, str, str]] = []

    async def get(self, kind: str, namespace: str, name: str) -> Any:
        self.asked.append((kind, namespace, name))
        answer = self.answers[name]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_webhook_reads_only_the_config_maps_it_needs_and_turns_failures_into_reasons() -> None:
    ok = {"data": {"config.yaml": "port: 8001\n"}}
    kube = FakeKube({"a": ok, "b": None, "c": ApiError(403, "forbidden"), "d": OSError("reset")})
    containers = [
        vllm("--config", f"/etc/{n}/config.yaml", volumeMounts=[{"name": n, "mountPath": f"/etc/{n}"}])
        for n in "abcd"
    ]
    p = {"spec": {"containers": containers, "volumes": [cm_volume(n, n) for n in "abcd"]}}
    read = asyncio.run(webhook.read_config_maps(kube, "ns", p))  # type: ignore[arg-type]
    assert read["a"] == ok
    assert read["b"] == Unreadable("no ConfigMap b in namespace ns")
    assert isinstance(read["c"], Unreadable) and "403" in read["c"].why
    assert isinstance(read["d"], Unreadable) and "reset" in read["d"].why
    assert sorted(kube.asked) == [("ConfigMap", "ns", n) for n in "abcd"]
    plain = FakeKube({})
    assert asyncio.run(webhook.read_config_maps(plain, "ns", pod(vllm()))) == {}  # type: ignore[arg-type]
    assert plain.asked == []
