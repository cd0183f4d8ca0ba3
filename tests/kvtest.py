"""Shared test support: free ports, waiting on conditions with deadlines, real servers as processes.

Nothing here fakes a part we can run: Redis is the real redis-server, the sidecar is the real
`kvpool-sidecar` process on a real socket.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def need(condition: bool, what: str) -> None:
    """Skip outside CI when something the test needs is missing; in CI a missing dependency fails."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"missing dependency in CI: {what}")
    pytest.skip(f"needs {what}")


def need_tool(name: str, what: str) -> str:
    """The path of program `name`; skipped without it outside CI, failed in CI (need)."""
    path = shutil.which(name)
    need(path is not None, what)
    assert path is not None  # need() returned: it is there
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gone(Exception):
    """Raised by a condition when what it waits on has ended for good (a process exited): wait_until
    fails at once instead of at its deadline."""


def write_auth(arena_dir: Path | str) -> dict[str, str]:
    """The header HTTP writes to a sidecar carry: its write token, read from beside the arena."""
    from kvpool_sidecar.wire import WRITE_TOKEN_FILE

    return {"Authorization": "Bearer " + (Path(arena_dir) / WRITE_TOKEN_FILE).read_text()}


def auth_line(arena_dir: Path | str) -> str:
    """write_auth as a header line, for hand-made requests."""
    return "".join(f"{k}: {v}\r\n" for k, v in write_auth(arena_dir).items())


def wait_until(condition: Callable[..., T | None], timeout: float = 30.0, what: str = "condition") -> T:
    """Polls `condition` until it returns a truthy value; fails with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Gone:
            raise
        except Exception as e:  # the condition may raise while the thing starts
            last_error = e
        time.sleep(0.02)
    raise TimeoutError(
        f"timed out after {timeout}s waiting for {what}" + (f": {last_error!r}" if last_error else "")
    )


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Proc:
    """A child process with its log file; stop() is idempotent."""

    popen: subprocess.Popen
    log: Path
    info: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    with log.open("wb") as f:  # the child writes to its own copy of the descriptor
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return Proc(popen, log)


# --- Redis ----------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    port: int
    dir: Path
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> RedisServer:
        binary = need_tool("redis-server", "redis-server (apt-get install redis-server)")
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--protected-mode",
            "no",
        ]
        self.proc = spawn(argv, self.dir / "redis.log")
        wait_until(self.ping, 15, f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
            wait_until(lambda: not self.ping(), 15, "redis-server to stop")


@contextlib.contextmanager
def redis_server(port: int | None = None) -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="kvpool-redis-") as d:
        server = RedisServer(port or free_port(), Path(d)).start()
        try:
            yield server
        finally:
            server.stop()


def redis_call(
    port: int,
    *args: str | bytes,
    password: str | None = None,
    host: str = "127.0.0.1",
    user: str | None = None,
) -> bytes:
    """One command over a raw socket (no client library between the test and the server), after
    AUTH [user] password when given."""
    with socket.create_connection((host, port), timeout=2) as s:
        if password:
            s.sendall(_resp("AUTH", *([user] if user else []), password))
            s.recv(64)
        s.sendall(_resp(*args))
        return s.recv(65536)


def _resp(*args: str | bytes) -> bytes:
    out = f"*{len(args)}\r\n".encode()
    for a in args:
        b = a if isinstance(a, bytes) else a.encode()
        out += b"$%d\r\n%s\r\n" % (len(b), b)
    return out


@contextlib.contextmanager
def redis_with(
    *extra: str, password: str | None = None, port: int | None = None, host: str = "127.0.0.1"
) -> Iterator[tuple[int, Proc]]:
    """A real redis-server with extra arguments (a password, cluster mode), on `host` (a loopback address)."""
    binary = need_tool("redis-server", "redis-server")
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="kvpool-redis-") as d:
        argv = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
                "--dir", d, "--protected-mode", "no", *extra]  # fmt: skip
        if password:
            argv += ["--requirepass", password]
        proc = spawn(argv, Path(d) / "redis.log")
        try:
            try:
                wait_until(
                    lambda: b"PONG" in redis_call(port, "PING", password=password, host=host),
                    15,
                    "redis-server",
                )
            except TimeoutError:
                raise RuntimeError(f"redis-server did not start:\n{proc.output()}") from None
            yield port, proc
        finally:
            proc.stop()


# --- kvpool-sidecar -------------------------------------------------------------------------------


def sidecar_argv(
    port: int, arena_dir: Path, capacity: str | int, redis_urls: Sequence[str] = (), *extra: str
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "kvpool_sidecar",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--capacity",
        str(capacity),
        "--arena-dir",
        str(arena_dir),
    ]
    for url in redis_urls:
        argv += ["--redis-url", url]
    return argv + list(extra)


def start_sidecar(
    workdir: Path,
    capacity: str | int = "64Mi",
    redis_urls: Sequence[str] = (),
    *extra: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """Starts the real sidecar process (with `env` added to this one's) and waits for /healthz."""
    port = port or free_port()
    arena_dir = workdir / f"arena-{port}"
    arena_dir.mkdir(parents=True, exist_ok=True)
    proc = spawn(
        sidecar_argv(port, arena_dir, capacity, list(redis_urls), *extra),
        workdir / f"sidecar-{port}.log",
        env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.alive() and http_ok(url + "/healthz"), 30, f"sidecar on {url}")
    except TimeoutError:
        proc.kill()
        raise RuntimeError(f"sidecar did not start:\n{proc.output()}") from None
    if "--arena-dir" in extra:  # the last one given wins, as argparse reads them
        arena_dir = Path(extra[len(extra) - 1 - list(reversed(extra)).index("--arena-dir") + 1])
    proc.info.update(url=url, port=port, arena_dir=arena_dir)
    return proc
