"""A kubelet for the operator's own pods, where kwok's would lie: kwok marks a pod Ready the moment it
is scheduled, so a Deployment would roll over to replicas whose process has not read the pools yet.

Pods annotated `kwok.x-k8s.io/status: custom` are left alone by kwok and run here instead: each gets a
loopback address, a real `kvpool-operator` process as the pod (operatorkit), and a Ready condition
that follows the pod's own readiness probe, as a kubelet's would. A deleted pod's process is stopped
(SIGTERM, then the pod is removed); `kill` is a lost node: SIGKILL, and the pod force-deleted.
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

from kvtest import Proc

from kubeharness.controlplane import ControlPlane, get_json

CUSTOM_STATUS = {"kwok.x-k8s.io/status": "custom"}  # kwok --disregard-status-with-annotation-selector
_addresses = (f"127.89.{i // 250}.{i % 250 + 1}" for i in itertools.count())


class LocalKubelet:
    def __init__(self, cp: ControlPlane, namespace: str, selector: str, workdir: Path) -> None:
        self.cp, self.namespace, self.selector, self.workdir = cp, namespace, selector, workdir
        self.running: dict[str, tuple[str, Proc]] = {}  # pod name -> (its IP, its process)
        self.ever: dict[str, Proc] = {}  # every pod's process, gone ones too: their logs stay readable
        self.ready: dict[str, bool] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="local-kubelet", daemon=True)

    def start(self) -> LocalKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            for _, proc in self.running.values():
                proc.stop()

    def kill(self, pod: str) -> None:
        """A lost node: the process dies without a word and the pod is force-deleted."""
        with self._lock:
            _, proc = self.running.pop(pod)
            proc.kill()
        self.cp.kubectl(
            "-n", self.namespace, "delete", "pod", pod, "--grace-period=0", "--force", check=False
        )

    def log(self, pod: str) -> str:
        return self.ever[pod].output()

    # --- one pass every 0.2 s --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._sync()
            except Exception as e:  # the API server may be busy; the next pass retries
                print(f"local kubelet: {e!r}")

    def _sync(self) -> None:
        from kubeharness.operatorkit import spawn_operator_as

        pods = get_json(self.cp, "-n", self.namespace, "pods", "-l", self.selector)["items"]
        seen = set()
        for pod in pods:
            name = pod["metadata"]["name"]
            seen.add(name)
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(name)
                continue
            if not pod["spec"].get("nodeName"):
                continue  # not scheduled yet
            with self._lock:
                if name not in self.running:
                    ip = next(_addresses)
                    self._status(name, {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                                        "hostIP": "127.88.255.254"}, ready=False)  # fmt: skip
                    pod["status"]["podIP"] = ip
                    self.running[name] = (ip, spawn_operator_as(self.cp, pod, self.workdir))
                    self.ever[name] = self.running[name][1]
                    self.ready[name] = False
            ready = readiness_probe_passes(pod, self.running[name][0])
            if ready != self.ready.get(name):
                self._status(name, {}, ready=ready)
                self.ready[name] = ready
        for gone in set(self.running) - seen:
            self._terminate(gone)

    def _terminate(self, name: str) -> None:
        with self._lock:
            entry = self.running.pop(name, None)
        if entry is not None:
            entry[1].stop()  # SIGTERM: kopf leaves its peering entry, so a standby takes over at once
        self.cp.kubectl("-n", self.namespace, "delete", "pod", name, "--grace-period=0", "--force",
                        "--ignore-not-found", check=False)  # fmt: skip

    def _status(self, name: str, fields: dict[str, Any], ready: bool) -> None:
        state = "True" if ready else "False"
        conditions = [{"type": t, "status": state} for t in ("Ready", "ContainersReady")]
        conditions.append({"type": "Initialized", "status": "True"})
        body = {"status": {**fields, "conditions": conditions}}
        patch = ["--subresource=status", "--type=strategic", "-p", json.dumps(body)]
        self.cp.kubectl("-n", self.namespace, "patch", "pod", name, *patch)


def readiness_probe_passes(pod: dict[str, Any], ip: str) -> bool:
    """The pod's own HTTP readiness probe, asked at `ip`, as a kubelet asks it."""
    get = pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    port = ports.get(get["port"], get["port"])
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}{get['path']}", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
