"""Real AdmissionReview requests to the operator's webhook, and their JSON patches applied."""

from __future__ import annotations

import base64
import copy
import json
import ssl
import urllib.request
import uuid
from typing import Any

import jsonpatch


def review(
    url: str, pod: dict[str, Any], namespace: str, *, dry_run: bool = False, tls: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """POSTs an AdmissionReview for creating `pod` (as a ReplicaSet would: no name, no namespace)."""
    body: dict[str, Any] = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller", "groups": []},
            "object": pod,
            "oldObject": None,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10, context=tls) as rsp:
        answer = json.loads(rsp.read())
    assert answer["kind"] == "AdmissionReview" and answer["response"]["uid"] == body["request"]["uid"]
    return answer["response"]


def admitted(url: str, pod: dict[str, Any], namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pod as the API server would store it after this webhook, the response)."""
    response = review(url, pod, namespace)
    assert response["allowed"] is True, response
    result = copy.deepcopy(pod)
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"]))
        result = jsonpatch.apply_patch(result, ops)
    return result, response


def take_skip_reason(pod: dict[str, Any]) -> str:
    """Removes the webhook's kvpool.dev/skipped annotation from `pod` (and the annotations it made) and
    returns it: what is left is compared with the pod as sent."""
    annotations = pod["metadata"]["annotations"]
    reason = annotations.pop("kvpool.dev/skipped")
    if not annotations:
        del pod["metadata"]["annotations"]
    return reason
