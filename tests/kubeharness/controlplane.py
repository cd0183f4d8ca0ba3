"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake nodes that turn scheduled pods Running and Ready without a kubelet).

The binaries are built from the Go module proxy by scripts/get-k8s.sh into .tools/k8s/bin. The API
server runs as a real cluster's would: client-certificate and service-account authentication, RBAC
(and Node) authorization, the default admission plugins (Pod Security, ServiceAccount, the webhooks,
ResourceQuota, ...) plus NodeRestriction, and the built-in controllers (ReplicaSets, garbage
collection, ServiceAccounts, EndpointSlices) from the controller manager.

There is no kube-proxy and no pod network: kwok gives pods addresses in 127.0.0.0/8, so a process a
test starts on a pod's address is that pod for whoever dials it (the operator scraping a sidecar), and
the API server reaches Services through `ServiceNetwork`, an HTTP CONNECT hop configured as its egress
(the way konnectivity routes a real API server's webhook calls) that maps a Service's cluster IP to one
of its ready pods, as kube-proxy would.
"""

from __future__ import annotations

import functools
import json
import shutil
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtest import REPO, Proc, free_port, http_ok, spawn, wait_until

from kubeharness.objects import condition, write_kubeconfig

BIN = REPO / ".tools" / "k8s" / "bin"
STAGES = REPO / ".tools" / "k8s" / "stages"
POD_CIDR = "127.88.0.0/16"  # kwok hands pods addresses from here: loopback, so tests can serve on them
SERVICE_CIDR = "10.96.0.0/16"
NODE_NAME = "kwok-node-0"


def binary(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run scripts/get-k8s.sh (make test does)")
    return path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass
class PKI:
    """A CA, the API server's serving certificate, an admin client certificate and the service-account
    signing key, made with openssl in `dir`."""

    dir: Path

    def make(self) -> PKI:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvpool-test-ca",
                 "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
        self._leaf("apiserver", "/CN=kube-apiserver",
                   "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                   "DNS:kubernetes.default.svc,IP:10.96.0.1\nextendedKeyUsage=serverAuth")  # fmt: skip
        self._leaf("admin", "/O=system:masters/CN=kvpool-test-admin", "extendedKeyUsage=clientAuth")
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
        return self

    def _leaf(self, name: str, subject: str, extensions: str) -> None:
        (self.dir / f"{name}.ext").write_text(extensions + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=self.dir)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=self.dir)  # fmt: skip

    def path(self, name: str) -> str:
        return str(self.dir / name)


@dataclass
class ControlPlane:
    dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    apiserver_port: int = 0
    network: Any = None  # ServiceNetwork, started with the API server

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    def start(self) -> ControlPlane:
        from kubeharness.servicenet import ServiceNetwork

        self.pki = PKI(self.dir / "pki").make()
        try:
            self._etcd()
            self.network = ServiceNetwork(self, self.dir / "service-network.sock").start()
            self._apiserver()
            self.write_kubeconfig(self.kubeconfig, {"client-certificate": self.pki.path("admin.crt"),
                                                    "client-key": self.pki.path("admin.key")})  # fmt: skip
            self._controller_manager()
            self._scheduler()
            self._kwok()
            self._node()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            if name in self.procs:
                self.procs[name].stop(timeout=20)
        if self.network is not None:
            self.network.stop()

    # --- the processes ---------------------------------------------------------------------------

    def _run(self, name: str, argv: list[str | Path]) -> Proc:
        proc = spawn([str(a) for a in argv], self.dir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, ready: Any, timeout: float = 90) -> None:
        proc = self.procs[name]
        try:
            wait_until(lambda: not proc.alive() or ready(), timeout, f"{name} to be ready")
            failure = None if proc.alive() else f"{name} exited ({proc.popen.returncode})"
        except TimeoutError as e:
            failure = str(e)
        if failure:
            raise RuntimeError(f"{failure}\n--- {name} log (tail) ---\n{proc.output()[-4000:]}")

    def _etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._run("etcd", [binary("etcd"), "--name", "kvpool-test", "--data-dir", self.dir / "etcd",
                           "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                           "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-cluster", f"kvpool-test=http://127.0.0.1:{peer}",
                           "--unsafe-no-fsync", "--log-level", "warn"])  # fmt: skip
        self._wait("etcd", lambda: http_ok(self.etcd_url + "/readyz", timeout=2))

    def _apiserver(self) -> None:
        self.apiserver_port = free_port()
        pki = self.pki.path
        egress = self.dir / "egress.yaml"
        egress.write_text(self.network.egress_config())
        self._run("kube-apiserver", [
            binary("kube-apiserver"),
            "--etcd-servers", self.etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.apiserver_port),
            "--tls-cert-file", pki("apiserver.crt"), "--tls-private-key-file", pki("apiserver.key"),
            "--client-ca-file", pki("ca.crt"),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", pki("sa.pub"), "--service-account-signing-key-file", pki("sa.key"),
            "--api-audiences", "https://kubernetes.default.svc.cluster.local",
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction",  # on top of the defaults, as kubeadm does
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--allow-privileged=true",
            "--egress-selector-config-file", egress,
            "--endpoint-reconciler-type=none",  # the `kubernetes` Service may not point at a loopback address
            "--profiling=false",
        ])  # fmt: skip
        self._wait("kube-apiserver", lambda: self.get("/readyz", raw=True) == "ok", 120)

    def _controller_manager(self) -> None:
        kc = str(self.kubeconfig)
        self._run("kube-controller-manager", [
            binary("kube-controller-manager"), "--kubeconfig", kc,
            "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--use-service-account-credentials=false",
            "--service-account-private-key-file", self.pki.path("sa.key"),
            "--root-ca-file", self.pki.path("ca.crt"),
            "--cluster-signing-cert-file", self.pki.path("ca.crt"),
            "--cluster-signing-key-file", self.pki.path("ca.key"),
            # (the node lifecycle controller stays: it lifts the not-ready taint a new node is created with)
        ])  # fmt: skip
        # the default ServiceAccount exists once the controllers run (pods need it)
        self._wait(
            "kube-controller-manager", lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default")
        )

    def _scheduler(self) -> None:
        kc = str(self.kubeconfig)
        self._run("kube-scheduler", [
            binary("kube-scheduler"), "--kubeconfig", kc,
            "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()), "--leader-elect=false",
        ])  # fmt: skip
        # no readiness endpoint without serving auth: its first scheduled pod shows it works (tests)

    def _kwok(self) -> None:
        argv: list[str | Path] = [
            binary("kwok"), "--kubeconfig", self.kubeconfig,
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            # pods that kubeharness/kubelet.py runs for real: kwok leaves their status alone
            "--disregard-status-with-annotation-selector=kwok.x-k8s.io/status=custom",
            "--cidr", POD_CIDR, "--node-ip", "127.88.255.254",
            # the node's heartbeat is its Lease, renewed as a kubelet does: the heartbeat-with-lease stage
            # writes node status only every 10 minutes, and without a Lease the node lifecycle controller
            # marks the node NotReady after its 50 s grace period, and with it every pod on it unready
            "--node-lease-duration-seconds=40",
            "--server-address", f"127.0.0.1:{free_port()}",
        ]  # fmt: skip
        self._run("kwok", [*argv, "--config", STAGES / "kwok-fast.yaml"])  # node and pod lifecycles

    def _node(self) -> None:
        """One fake node big enough for every test's pods."""
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE_NAME, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok"}},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "500"},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "500"}},
        }  # fmt: skip
        self.kubectl("apply", "-f", "-", stdin=json.dumps(node))

        def node_ready() -> bool:
            status = json.loads(self.kubectl("get", "node", NODE_NAME, "-o", "json"))["status"]
            return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))

        self._wait("kwok", node_ready, 60)

    # --- clients ---------------------------------------------------------------------------------

    def write_kubeconfig(self, path: Path, user: dict[str, str]) -> Path:
        return write_kubeconfig(path, self.server, user, ca=self.pki.path("ca.crt"))

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext:
        """The admin's TLS context, made once (the service network asks for it on every connection)."""
        ctx = ssl.create_default_context(cafile=self.pki.path("ca.crt"))
        ctx.load_cert_chain(self.pki.path("admin.crt"), self.pki.path("admin.key"))
        return ctx

    def get(self, path: str, raw: bool = False) -> Any:
        """GET as the admin; None on any error (for polling)."""
        try:
            with urllib.request.urlopen(self.server + path, context=self.ssl_context, timeout=5) as r:
                body = r.read().decode()
        except OSError:
            return None
        return body if raw else json.loads(body)

    def kubectl(self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None,
                check: bool = True, timeout: float = 120) -> str:  # fmt: skip
        result = self.kubectl_result(*args, kubeconfig=kubeconfig, stdin=stdin, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args[:6])} failed ({result.returncode}):\n{result.stderr}"
            )
        return result.stdout

    def kubectl_result(self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None,
                       timeout: float = 120) -> subprocess.CompletedProcess:  # fmt: skip
        argv = [str(kubectl_binary()), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        return subprocess.run(argv, capture_output=True, text=True, input=stdin, timeout=timeout)

    def token_kubeconfig(self, namespace: str, service_account: str, path: Path) -> Path:
        """A kubeconfig that authenticates as a ServiceAccount with a token from the TokenRequest API."""
        token = self.kubectl("-n", namespace, "create", "token", service_account, "--duration", "2h").strip()
        return self.write_kubeconfig(path, {"token": token})


def get_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json"))


def crd_established(cp: ControlPlane, name: str = "kvcachepools.kvpool.dev") -> bool:
    result = cp.kubectl_result("get", "crd", name, "-o", "json")
    return result.returncode == 0 and condition(json.loads(result.stdout), "Established") == "True"


def kubectl_binary() -> Path:
    return REPO / ".tools" / "bin" / "kubectl"


def have_binaries() -> bool:
    names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
    return all((BIN / n).exists() for n in names) and shutil.which("openssl") is not None
