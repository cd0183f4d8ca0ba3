"""`kvpool doctor [NAMESPACE]`: what makes a pool silently useless, each with how to fix it.

It asks the API server as the person running it (kubectl, with their kubeconfig and context) and
changes nothing. Its one write is a server-side dry run of a probe pod for each pool, which goes
through the webhook, LimitRanger and the quota admission as the pool's next pod would and is never
stored. What it looks at, beyond what a pool's own status says:
- the namespace is sent to exactly one kvpool webhook (its label; two releases that overlap);
- the probe pod gets the sidecar, or the webhook's reason why not (a LimitRange, a quota, an image
  whose vLLM fails with the connector, two pools selecting it), or, when no webhook answered it,
  why not (no ready endpoint behind its Service, no CA bundle);
- two pools of one namespace select the same pods;
- the pool's Ready condition (sidecars the operator cannot reach, Redis refusing them, ...).
Exit status 1 when it found something, 2 when it could not ask.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_operator import names
from kvpool_operator.injection import remove_injection
from kvpool_operator.selector import matches

WEBHOOK_NAME = "inject.kvpool.dev"  # the chart's webhook entry, whatever the release is called
PROBE_NAME = "kvpool-doctor-probe"
PROBE_IMAGE = "vllm/vllm-openai:latest"  # when the pool has no pod to take the image from

FIXES = {  # the pool's Ready reasons (README, "Is it working?") -> what to do
    "InvalidSpec": "fix the pool's spec as the message says",
    "Refused": "lift the quota or policy that refused it, then change the pool's spec",
    "VLLMFailing": "use a vLLM image that runs with kvpool's connector, then clear the breaker: "
    "kubectl annotate kvp {pool} kvpool.dev/reset-breaker=$(date +%s) --overwrite",
    "SidecarNotStarting": "fix spec.sidecar.image (or the chart's sidecarImage)",
    "InjectionNotEnabled": "kubectl label namespace {namespace} kvpool.dev/injection=enabled, "
    "then restart the pods",
    "SharedTierStarting": "see the shard pods: kubectl -n {namespace} get pods -l kvpool.dev/pool={pool}",
    "PodsNotReady": "see the pods the pool selects",
    "SidecarsNotAnswering": "let the operator reach each pod's sidecar status port (NetworkPolicy, mesh)",
    "RedisAuthFailed": "create the Secret the pool names (spec.redis.passwordSecretRef)",
    "RedisUnreachable": "fix spec.redis.url, or the Redis it names",
    "CacheOff": 'the model cannot be cached: annotate its pods kvpool.dev/inject: "false"',
}
SKIP_FIXES = {  # the webhook's reasons for admitting a pod without the cache -> what to do
    "LimitRangeExceeded": "raise the LimitRange by the sidecar's share, or lower the pool's capacity",
    "QuotaExceeded": "raise the ResourceQuota by the sidecar's share, or lower the pool's capacity",
    "SeveralPools": "make the pools' selectors disjoint",
    "VLLMFailing": FIXES["VLLMFailing"],
    "SidecarNotStarting": FIXES["SidecarNotStarting"],
}


@dataclass(frozen=True)
class Finding:
    where: str  # "namespace" or "namespace/pool"
    problem: str
    fix: str


class AskFailed(Exception):
    """kubectl could not answer (no cluster, no permission, no CRD)."""


class Cluster:
    """The API server through the user's kubectl."""

    def __init__(self, kubectl: Sequence[str] = ("kubectl",)) -> None:
        self.kubectl = list(kubectl)

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.kubectl, *args], input=stdin, capture_output=True, text=True, timeout=60)

    def get(self, *args: str) -> dict[str, Any]:
        done = self.run("get", *args, "-o", "json")
        if done.returncode != 0:
            raise AskFailed(f"kubectl get {' '.join(args)}: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def items(self, *args: str) -> list[dict[str, Any]]:
        return list(self.get(*args).get("items") or [])

    def dry_run(self, namespace: str, pod: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The pod as the API server would store it, or None and why it refused it."""
        done = self.run(
            "-n", namespace, "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(pod)
        )
        if done.returncode != 0:
            return None, done.stderr.strip()
        return json.loads(done.stdout), ""


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A webhook's namespaceSelector: empty selects every namespace."""
    return not (selector.get("matchLabels") or selector.get("matchExpressions")) or matches(selector, labels)


Hooks = list[tuple[str, dict[str, Any]]]  # (configuration name, webhook)


def webhooks(cluster: Cluster) -> Hooks:
    """(configuration name, webhook) of every kvpool release in the cluster."""
    return [
        (config["metadata"]["name"], hook)
        for config in cluster.items("mutatingwebhookconfigurations")
        for hook in config.get("webhooks") or []
        if hook.get("name") == WEBHOOK_NAME
    ]


def route(cluster: Cluster, namespace: str, hooks: Hooks) -> tuple[Hooks, list[Finding]]:
    """The kvpool webhooks the namespace's pods are sent to, and what is wrong with that."""
    labels = cluster.get("namespace", namespace)["metadata"].get("labels") or {}
    sent = [(name, hook) for name, hook in hooks if _selects(hook.get("namespaceSelector") or {}, labels)]
    if not hooks:
        return sent, [
            Finding(
                namespace,
                "no kvpool webhook is installed: no pod gets the cache",
                "helm install kvpool charts/kvpool (README, Run it on a cluster)",
            )
        ]
    if not sent:
        opt_in = {**labels, "kvpool.dev/injection": "enabled"}
        if any(_selects(hook.get("namespaceSelector") or {}, opt_in) for _, hook in hooks):
            return sent, [
                Finding(
                    namespace,
                    "the namespace is not labelled for injection: its pods never reach the webhook",
                    f"kubectl label namespace {namespace} kvpool.dev/injection=enabled",
                )
            ]
        return sent, [
            Finding(
                namespace,
                "every kvpool release excludes this namespace (watch.namespaces or "
                "webhook.excludeNamespaces)",
                "add it to the release's watch.namespaces",
            )
        ]
    found = []
    if len(sent) > 1:
        releases = ", ".join(name for name, _ in sent)
        found.append(
            Finding(
                namespace,
                f"{len(sent)} kvpool releases send this namespace's pods to their webhooks "
                f"({releases}): both inject, and their pools and operators disagree",
                "uninstall one, or split the namespaces between them (watch.namespaces)",
            )
        )
    return sent, found


def unanswered(cluster: Cluster, name: str, hook: Mapping[str, Any]) -> list[Finding]:
    """Why a webhook may not have answered: no CA bundle, no ready endpoint behind its Service."""
    where = f"webhook {name}"
    client = hook.get("clientConfig") or {}
    service = client.get("service") or {}
    found = []
    if not client.get("caBundle"):
        found.append(
            Finding(
                where,
                "it has no CA bundle: the API server cannot call it and admits pods without the cache",
                "with webhook.certManager, check the cert-manager CA injector; else helm upgrade the release",
            )
        )
    if service:
        ns, svc = service.get("namespace", ""), service.get("name", "")
        slices = cluster.items("endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={svc}")
        ready = [
            e for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")
        ]
        if not ready:
            found.append(
                Finding(
                    where,
                    f"Service {ns}/{svc} has no ready endpoint: every pod is created "
                    "without the cache (the webhook fails open)",
                    f"see the operator: kubectl -n {ns} get pods -l app.kubernetes.io/part-of=kvpool",
                )
            )
    return found


def check_pools(cluster: Cluster, namespace: str, pools: list[dict[str, Any]], sent: Hooks) -> list[Finding]:
    """Each pool's own state, pools that overlap, and (when the namespace's pods reach a webhook) what
    the pool's next pod would get."""
    found = []
    pods = cluster.items("pods", "-n", namespace)
    selected = {
        p["metadata"]["name"]: [
            pod["metadata"]["name"]
            for pod in pods
            if matches(p["spec"].get("selector") or {}, pod["metadata"].get("labels") or {})
        ]
        for p in pools
    }
    for i, a in enumerate(pools):
        for b in pools[i + 1 :]:
            both = set(selected[a["metadata"]["name"]]) & set(selected[b["metadata"]["name"]])
            if both:
                found.append(
                    Finding(
                        f"{namespace}/{a['metadata']['name']}",
                        f"it and pool {b['metadata']['name']} both select {len(both)} pod(s) "
                        f"({', '.join(sorted(both)[:3])}): those get no cache",
                        SKIP_FIXES["SeveralPools"],
                    )
                )
    for pool in pools:
        name = pool["metadata"]["name"]
        where = f"{namespace}/{name}"
        found += _condition(pool, namespace, name)
        if sent:
            mine = [pod for pod in pods if pod["metadata"]["name"] in selected[name]]
            found += _probe(cluster, namespace, pool, mine, sent)
        for reason, count in sorted(((pool.get("status") or {}).get("skipReasons") or {}).items()):
            found.append(
                Finding(
                    where,
                    f"{count} pod(s) run without the cache: {reason}",
                    SKIP_FIXES.get(reason, "README, Pods kvpool leaves alone"),
                )
            )
    return found


def _condition(pool: Mapping[str, Any], namespace: str, name: str) -> list[Finding]:
    conditions = (pool.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None:
        return [
            Finding(
                f"{namespace}/{name}",
                "the pool has no status: no operator has handled it",
                "see that the operator runs and watches this namespace (watch.namespaces)",
            )
        ]
    if ready.get("status") == "True":
        return []
    reason = str(ready.get("reason"))
    fix = FIXES.get(reason, "README, Is it working?").format(namespace=namespace, pool=name)
    return [Finding(f"{namespace}/{name}", f"not Ready ({reason}): {ready.get('message', '')}", fix)]


def probe_pod(pool: Mapping[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool's next pod: one of its pods as it was before kvpool touched it (its image, resources and
    security context count for the webhook, LimitRanger, the quota and Pod Security), else a vLLM
    pod that Pod Security `restricted` admits, with the labels the pool selects."""
    if pods:
        pod = remove_injection(pods[0])
        meta = pod["metadata"]
        pod["metadata"] = {"name": PROBE_NAME, "labels": meta.get("labels") or {},
                           "annotations": meta.get("annotations") or {}}  # fmt: skip
        pod.pop("status", None)
        pod["spec"].pop("nodeName", None)
        return pod
    selector = pool["spec"].get("selector") or {}
    labels = dict(selector.get("matchLabels") or {})
    for expr in selector.get("matchExpressions") or []:
        if expr["operator"] in ("In", "Exists"):
            labels[expr["key"]] = (expr.get("values") or ["kvpool-doctor"])[0]
    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    engine = {"name": pool["spec"].get("vllmContainer") or "vllm", "image": PROBE_IMAGE,
              "command": ["vllm", "serve"], "args": ["model"], "securityContext": restricted}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": PROBE_NAME, "labels": labels},
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [engine],
        },
    }


def _probe(
    cluster: Cluster, namespace: str, pool: Mapping[str, Any], pods: list[dict[str, Any]], sent: Hooks
) -> list[Finding]:
    """The end-to-end check: a dry run of the pool's next pod. Only when no webhook answered it are the
    webhooks' CA bundles and endpoints looked at, to say why."""
    where = f"{namespace}/{pool['metadata']['name']}"
    stored, refused = cluster.dry_run(namespace, probe_pod(pool, pods))
    if stored is None:
        return [
            Finding(
                where,
                f"the API server refuses a pod of this pool: {refused}",
                "the pod alone breaks the namespace's limits: fix the pod or the LimitRange/quota",
            )
        ]
    spec = stored.get("spec") or {}
    if any(
        c.get("name") == names.SIDECAR_CONTAINER
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]
    ):
        return []
    skipped = (stored["metadata"].get("annotations") or {}).get(names.SKIPPED_ANNOTATION)
    if skipped:
        reason = skipped.split(":", 1)[0]
        return [
            Finding(
                where,
                f"its next pod would run without the cache: {skipped}",
                SKIP_FIXES.get(reason, "README, Pods kvpool leaves alone"),
            )
        ]
    why = [f for name, hook in sent for f in unanswered(cluster, name, hook)]
    return why or [
        Finding(
            where,
            "its next pod would run without the cache, and the webhook said nothing "
            "(it did not answer in time, or another webhook undid it)",
            "see the operator's log",
        )
    ]


def diagnose(cluster: Cluster, namespace: str | None = None) -> list[Finding]:
    pools = cluster.items("kvcachepools.kvpool.dev", *(["-n", namespace] if namespace else ["-A"]))
    by_namespace: dict[str, list[dict[str, Any]]] = {namespace: []} if namespace else {}
    for pool in pools:
        by_namespace.setdefault(pool["metadata"]["namespace"], []).append(pool)
    hooks = webhooks(cluster)
    found: list[Finding] = []
    for ns, its_pools in sorted(by_namespace.items()):
        if not its_pools:
            found.append(
                Finding(ns, "no KVCachePool in this namespace", "kubectl apply a pool (README, A first pool)")
            )
            continue
        sent, wiring = route(cluster, ns, hooks)
        found += wiring + check_pools(cluster, ns, its_pools, sent)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpool doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("namespace", nargs="?", help="one namespace (default: every namespace with a pool)")
    parser.add_argument(
        "--kubectl", default="kubectl", help="the kubectl to run, with its flags (--context ...)"
    )
    args = parser.parse_args(argv)
    try:
        found = diagnose(Cluster(args.kubectl.split()), args.namespace)
    except (AskFailed, OSError, subprocess.TimeoutExpired) as e:
        print(f"kvpool doctor: cannot ask the cluster: {e}", file=sys.stderr)
        return 2
    for f in found:
        print(f"✗ {f.where}: {f.problem}\n    fix: {f.fix}")
    if not found:
        print("✓ every pool looked at can serve its pods")
    return 1 if found else 0
