"""The sidecar image, built from the project's Dockerfile with podman and run the way a pod runs it:
read-only root filesystem, no capabilities, the arena on a memory-backed mount, only the read-only
status port reachable from outside.

No registry is reachable here, so the base image is made from Debian's packages (base-image.sh) and
pip installs from a wheelhouse of the pinned requirements mounted into the build; the Dockerfile's
steps are the ones a normal build runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chartkit import REPO
from kvtest import free_port, http_ok, need, wait_until

PODMAN_DIR = Path(__file__).parent / "podman"
BASE_IMAGE = "localhost/kvpool-test-python:3.11-bookworm"
FORBIDDEN_IN_SIDECAR = ("torch", "vllm", "kopf", "transformers")


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args[:3])} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """Builds a target of the project's Dockerfile (PYTHON_IMAGE the Debian-made base, pip from a
    wheelhouse of the pinned requirements); returns its tag. Images are removed afterwards."""
    need(shutil.which("podman") is not None, "podman (apt-get install podman)")
    old_conf = os.environ.get("CONTAINERS_CONF")
    os.environ["CONTAINERS_CONF"] = str(
        PODMAN_DIR / "containers.conf"
    )  # podman reads it; /etc stays as it is
    base = subprocess.run(
        ["bash", str(PODMAN_DIR / "base-image.sh"), BASE_IMAGE], capture_output=True, text=True
    )
    need(base.returncode != 2, f"the tools base-image.sh needs: {base.stderr.strip()}")
    assert base.returncode == 0, base.stderr

    wheelhouse = tmp_path_factory.mktemp("wheelhouse")
    download = subprocess.run(
        [
            "bash",
            PODMAN_DIR / "wheelhouse.sh",
            wheelhouse,
            *(REPO / "requirements" / f for f in ("sidecar.txt", "build.txt")),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert download.returncode == 0, download.stderr
    tags: list[str] = []

    def image(target: str, *build_args: str) -> str:
        tag = f"localhost/kvpool-{target}:test-{os.getpid()}"
        args = [a for b in build_args for a in ("--build-arg", b)]
        podman("build", "--target", target, "--tag", tag, "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}",
               "--build-arg", "PIP_NO_INDEX=1", "--build-arg", "PIP_FIND_LINKS=/wheelhouse", *args,
               "--volume", f"{wheelhouse}:/wheelhouse:ro", str(REPO))  # fmt: skip
        tags.append(tag)
        return tag

    yield image
    for tag in tags:
        podman("rmi", "--force", tag, check=False)
    if old_conf is None:
        os.environ.pop("CONTAINERS_CONF", None)
    else:
        os.environ["CONTAINERS_CONF"] = old_conf


@pytest.fixture(scope="module")
def sidecar_image(build: Callable[..., str]) -> str:
    return build("sidecar")


@pytest.fixture
def sidecar_container(sidecar_image: str) -> Iterator[str]:
    """The sidecar started as the webhook starts it in a pod; yields the status port's URL."""
    port = free_port()
    name = f"kvpool-sidecar-test-{os.getpid()}-{port}"
    podman(
        "run",
        "--detach",
        "--name",
        name,
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--tmpfs",
        "/var/run/kvpool:rw,size=80m,mode=1777",
        "--publish",
        f"127.0.0.1:{port}:7071",
        sidecar_image,
        "--capacity",
        "32Mi",
        "--arena-dir",
        "/var/run/kvpool",
        "--status-port",
        "7071",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(lambda: http_ok(url + "/healthz"), 60, f"/healthz of the sidecar container at {url}")
        except TimeoutError:
            raise AssertionError(podman("logs", name, check=False).stdout) from None
        yield url
    finally:
        podman("rm", "--force", name, check=False)


def test_sidecar_container_serves_health_and_stats(sidecar_container: str) -> None:
    with urllib.request.urlopen(sidecar_container + "/healthz", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(sidecar_container + "/stats", timeout=5) as r:
        stats = json.load(r)
    assert stats["capacity_bytes"] == 32 * 2**20 and stats["chunks"] == 0


def test_status_port_does_not_expose_the_data_api(sidecar_container: str) -> None:
    request = urllib.request.Request(sidecar_container + "/v1/chunks/" + "ab" * 16, data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code in (404, 405)


def test_sidecar_image_is_non_root_and_lean(sidecar_image: str) -> None:
    (config,) = json.loads(podman("image", "inspect", sidecar_image).stdout)
    assert config["Config"]["User"] == "65532:65532"
    assert config["Config"]["Entrypoint"] == ["kvpool-sidecar"]
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    found = podman(
        "run", "--rm", "--entrypoint", "python3", sidecar_image, "-c", probe, *FORBIDDEN_IN_SIDECAR
    )
    assert found.stdout.strip() == "[]"


def test_every_sidecar_module_imports_in_the_image(sidecar_image: str) -> None:
    """The Redis tier is imported only when a pool has one: a dependency missing for the image's own
    Python (async-timeout, which redis-py needs before 3.11.3) showed first as a crash-looping sidecar on
    the real node."""
    probe = (
        "import importlib, pkgutil, kvpool_sidecar as p; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(p.__path__, 'kvpool_sidecar.')]"
    )
    podman("run", "--rm", "--entrypoint", "python3", sidecar_image, "-c", probe)


def test_the_connector_image_keeps_the_vllm_images_user(build: Callable[..., str], tmp_path: Path) -> None:
    """A vLLM image that runs as uid 4321 (its Python in a venv, as vLLM's images have theirs): the
    connector image built on it runs as 4321 too, with nothing to pass, and imports the connector."""
    vllm = f"localhost/kvpool-test-vllm:{os.getpid()}"
    (tmp_path / "Containerfile").write_text(
        f"FROM {BASE_IMAGE}\nRUN python3 -m venv /opt/vllm\nENV PATH=/opt/vllm/bin:$PATH\nUSER 4321\n"
    )
    podman("build", "--tag", vllm, str(tmp_path))
    try:
        connector = build("connector", f"VLLM_IMAGE={vllm}")
        (config,) = json.loads(podman("image", "inspect", connector).stdout)
        assert config["Config"]["User"] == "4321"
        probe = "import os, kvpool_connector, kvpool_sidecar.client, xxhash; print(os.getuid())"
        assert podman("run", "--rm", connector, "python3", "-c", probe).stdout.strip() == "4321"
    finally:
        podman("rmi", "--force", vllm, check=False)


# --- the connector payload: what the operator's init container copies into a stock vLLM image's pod ---

PAYLOAD_PROBE = """
import hashlib, importlib, os, sys
import xxhash
connector = importlib.import_module("kvpool_connector")  # as vLLM's KVConnectorFactory loads a module path
from kvpool_connector.keys import chunk_keys
from kvpool_sidecar.client import SidecarClient, checksum
assert connector.__file__.startswith("/opt/kvpool-connector/"), connector.__file__
assert xxhash.__file__.startswith("/opt/kvpool-connector/"), xxhash.__file__
print(sys.version_info[:2], checksum(b"kvpool"), os.getuid())
"""


@pytest.fixture(scope="module")
def staged_payload(sidecar_image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The payload as a pod gets it: the webhook's own init container (command, user) run from the
    sidecar image into an empty directory."""
    from kvpool_operator.injection import connector_container
    from kvpool_operator.pool import parse_pool
    from kvpool_operator.settings import OperatorSettings

    pool = parse_pool("ns", "p", {"selector": {}})
    init = connector_container(pool, OperatorSettings(sidecar_image=sidecar_image))
    out = tmp_path_factory.mktemp("payload")
    out.chmod(0o777)  # an emptyDir: writable by any uid
    (mount,) = init["volumeMounts"]
    podman("run", "--rm", "--read-only", "--cap-drop", "ALL", "--volume", f"{out}:{mount['mountPath']}",
           "--entrypoint", init["command"][0], init["image"], *init["command"][1:])  # fmt: skip
    return out


def payload_imports(image: str, payload: Path) -> str:
    """The probe run by the image's own python3, as a user the payload's files were not made for, with
    the payload mounted read-only where the webhook mounts it and first on PYTHONPATH."""
    return podman("run", "--rm", "--read-only", "--user", "4321", "--volume",
                  f"{payload}:/opt/kvpool-connector:ro", "--env", "PYTHONPATH=/opt/kvpool-connector",
                  "--entrypoint", "python3", image, "-c", PAYLOAD_PROBE).stdout.strip()  # fmt: skip


def test_the_payload_carries_xxhash_for_every_python_and_machine(staged_payload: Path) -> None:
    built = sorted(p.name for p in (staged_payload / "xxhash").glob("_xxhash.*.so"))
    assert built == [
        f"_xxhash.cpython-3{minor}-{machine}-linux-gnu.so"
        for minor in range(10, 15)
        for machine in ("aarch64", "x86_64")
    ]
    assert not list(staged_payload.rglob("__pycache__"))


def test_the_payload_imports_on_a_python_that_has_none_of_its_packages(staged_payload: Path) -> None:
    """Debian bookworm's bare python3 (3.11): no xxhash, no kvpool; everything comes from the payload."""
    out = payload_imports(BASE_IMAGE, staged_payload)
    assert out.startswith("(3, 11) ") and out.endswith(" 4321")


def test_the_payload_imports_on_python_3_13(staged_payload: Path) -> None:
    """Debian trixie's python3 (3.13), another compiled xxhash module from the same directory."""
    image = "localhost/kvpool-test-python:3.13-trixie"
    base = subprocess.run(["bash", str(PODMAN_DIR / "base-image.sh"), image, "trixie"], capture_output=True,
                          text=True)  # fmt: skip
    assert base.returncode == 0, base.stderr
    out = payload_imports(image, staged_payload)
    assert out.startswith("(3, 13) ") and out.endswith(" 4321")
    assert out.split()[2] == payload_imports(BASE_IMAGE, staged_payload).split()[2]  # the same checksum


def test_the_payload_needs_no_python_newer_than_3_10() -> None:
    """vLLM's images run Python 3.10 to 3.13; no 3.10 or 3.12 interpreter is packaged for this machine,
    so those are checked by what the code uses (vermin reads the syntax and the standard library's API)."""
    sources = [REPO / "connector" / "src" / "kvpool_connector", REPO / "sidecar" / "src" / "kvpool_sidecar"]
    vermin = Path(sys.executable).parent / "vermin"
    result = subprocess.run([str(vermin), "--no-tips", "--eval-annotations", "--violations",
                             "-t=3.10-", *map(str, sources)], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
