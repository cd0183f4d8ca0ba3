"""The pod network's part the API server needs, for a control plane without kube-proxy: an HTTP CONNECT
endpoint that the API server uses as its "cluster" egress (EgressSelectorConfiguration, the mechanism
konnectivity uses), mapping `CONNECT <cluster IP>:<port>` to a ready pod behind that Service, as
kube-proxy would. Pods have loopback addresses (kwok's CIDR), so the pod is whatever a test serves there.

The webhook's TLS is untouched: the API server still checks the certificate against the caBundle and
the Service's DNS name; this only carries the bytes.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import select
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any


class ServiceNetwork:
    def __init__(self, control_plane: Any, socket_path: Path) -> None:
        self.cp = control_plane
        self.socket_path = socket_path
        self.connects: list[str] = []  # every target the API server asked for, for tests to read
        self.routes: list[tuple[str, str]] = []  # (target, the pod IP it went to)
        self._turn = itertools.count()
        self._open: set[socket.socket] = set()  # the API server keeps its connections alive: see reset()
        # resolve()'s reads, over one kept-alive connection: a new TLS handshake for each of a call's
        # two reads cost ~19 ms a webhook call, where kube-proxy forwards from a table in the kernel
        self._api: http.client.HTTPSConnection | None = None
        self._api_lock = threading.Lock()

    def start(self) -> ServiceNetwork:
        network = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                network._handle(self.request)

        class Server(socketserver.ThreadingUnixStreamServer):
            # socketserver's default backlog is 5; the API server dials without blocking, so a burst
            # of webhook calls past it was refused (EAGAIN) and its pods admitted untouched
            request_queue_size = socket.SOMAXCONN

        self.server = Server(str(self.socket_path), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="service-network", daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self._api_lock:
            if self._api is not None:
                self._api.close()

    def egress_config(self) -> str:
        return (
            "apiVersion: apiserver.k8s.io/v1beta1\nkind: EgressSelectorConfiguration\negressSelections:\n"
            "- name: cluster\n  connection:\n    proxyProtocol: HTTPConnect\n"
            f"    transport:\n      uds:\n        udsName: {self.socket_path}\n"
        )

    # --- one CONNECT -------------------------------------------------------------------------------

    def _handle(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(4096)
            if not chunk:
                return
            head += chunk
        request_line = head.split(b"\r\n", 1)[0].decode()
        method, target, _ = request_line.split(" ", 2)
        self.connects.append(target)
        backend = self.resolve(target) if method == "CONNECT" else None
        if backend is None:
            client.sendall(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
            return
        try:
            upstream = socket.create_connection(backend, timeout=5)
        except OSError:
            client.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            return
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        self._open.add(client)
        try:
            _pump(client, upstream)
        finally:
            self._open.discard(client)

    def reset(self) -> None:
        """Drops every open connection (as an endpoint change does): the next call picks a pod anew."""
        for conn in list(self._open):
            with contextlib.suppress(OSError):  # already closed by its other end
                conn.shutdown(socket.SHUT_RDWR)

    def resolve(self, target: str) -> tuple[str, int] | None:
        """<cluster IP>:<port> -> (a ready pod's IP, the target port), or None."""
        host, _, port_text = target.rpartition(":")
        # an API error is not "no such service": asked again before the call fails open
        answer = self._get("/api/v1/services") or self._get("/api/v1/services")
        services = (answer or {}).get("items", [])
        for svc in services:
            if svc["spec"].get("clusterIP") != host:
                continue
            ports = [p for p in svc["spec"].get("ports", []) if p["port"] == int(port_text)]
            selector = svc["spec"].get("selector")
            if not ports or not selector:
                return None
            namespace = svc["metadata"]["namespace"]
            query = ",".join(f"{k}={v}" for k, v in selector.items())
            pods = (self._get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={query}") or {}).get(
                "items", []
            )
            ready = [p for p in pods if _ready(p)]
            if not ready:
                return None
            pod = sorted(ready, key=lambda p: p["metadata"]["name"])[
                next(self._turn) % len(ready)
            ]  # round robin
            self.routes.append((target, pod["status"]["podIP"]))
            return pod["status"]["podIP"], _target_port(pod, ports[0].get("targetPort", ports[0]["port"]))
        return None

    def _get(self, path: str) -> Any:
        """GET as the admin (as ControlPlane.get: None on any error), reconnecting once if the kept
        connection broke (an API server restarted, or one that closed it idle)."""
        with self._api_lock:
            for _ in range(2):
                try:
                    if self._api is None:
                        port, context = self.cp.apiserver_port, self.cp.ssl_context
                        self._api = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
                    self._api.request("GET", path)
                    response = self._api.getresponse()
                    body = response.read()
                    return json.loads(body) if response.status == 200 else None
                except (OSError, http.client.HTTPException, ValueError):
                    if self._api is not None:
                        self._api.close()
                    self._api = None
            return None


def _ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp") or not pod.get("status", {}).get("podIP"):
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _target_port(pod: dict[str, Any], target: int | str) -> int:
    if isinstance(target, int):
        return target
    for container in pod["spec"]["containers"]:
        for port in container.get("ports", []):
            if port.get("name") == target:
                return int(port["containerPort"])
    raise LookupError(f"no container port named {target} in {pod['metadata']['name']}")


def _pump(a: socket.socket, b: socket.socket) -> None:
    """Copies bytes both ways until either side closes."""
    sockets = [a, b]
    try:
        while True:
            readable, _, _ = select.select(sockets, [], [], 60)
            if not readable:
                return
            for s in readable:
                data = s.recv(65536)
                if not data:
                    return
                (b if s is a else a).sendall(data)
    except OSError:
        return
    finally:
        b.close()
