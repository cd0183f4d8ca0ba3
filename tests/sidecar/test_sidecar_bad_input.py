"""Bad input gets a 4xx JSON error, commits no memory, and the sidecar keeps serving."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator

import pytest
from kvtest import Proc, auth_line, start_sidecar, wait_until, write_auth
from sidecar_support import key, load, save

from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.client_errors import SidecarError
from kvpool_sidecar.wire import slot_from_json

JSON = {"Content-Type": "application/json"}
GOOD = key(1)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> Iterator[Proc]:
    """One process for the whole module: every test also checks it was left empty and serving."""
    proc = start_sidecar(tmp_path_factory.mktemp("bad-input"), "4Mi", [], "--max-chunk-bytes", "1Mi")
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


def nothing_committed(s: dict) -> bool:
    """Of a sidecar's /stats."""
    return s["stored_bytes"] == 0 and s["reserved_chunks"] == 0 and s["free_bytes"] == s["capacity_bytes"]


def still_serving(url: str) -> None:
    c = SidecarClient(url, timeout=5)
    assert c.healthz()
    assert c.put(key(2, "after"), b"fine") and c.get(key(2, "after")) == b"fine"
    assert c.delete(key(2, "after"))
    c.close()


BAD_REQUESTS = [
    ("POST", "/v1/lookup", b'{"keys": [', JSON, 422),  # malformed JSON
    ("POST", "/v1/lookup", b'{"keys": "abc"}', JSON, 422),
    ("POST", "/v1/lookup", b'{"keys": ["ABCDEF0123456789ABCDEF0123456789"]}', JSON, 422),  # upper case
    ("POST", "/v1/lookup", b'{"keys": ["0123"]}', JSON, 422),  # too short
    ("POST", "/v1/lookup", json.dumps({"keys": ["a" * 129]}).encode(), JSON, 422),  # too long
    ("POST", "/v1/lookup", json.dumps({"keys": ["g" * 32]}).encode(), JSON, 422),  # not hex
    ("POST", "/v1/lookup", json.dumps({"keys": [GOOD], "extra": 1}).encode(), JSON, 422),
    ("PUT", "/v1/chunks/XYZ", b"data", {}, 422),
    ("PUT", "/v1/chunks/" + "A" * 32, b"data", {}, 422),
    ("GET", "/v1/chunks/" + "0" * 31, None, {}, 422),
    ("DELETE", "/v1/chunks/..%2f..%2fetc", None, {}, 404),
    ("PUT", f"/v1/chunks/{GOOD}", b"x" * (2**20 + 1), {}, 413),  # over --max-chunk-bytes
    ("PUT", f"/v1/chunks/{GOOD}", b"data", {"X-KVPool-Priority": "high"}, 422),
    ("POST", "/v1/arena/reserve", b'{"items": [{"key": "' + GOOD.encode() + b'", "length": -1}]}', JSON, 422),
    ("POST", "/v1/arena/reserve", json.dumps({"items": [{"key": GOOD, "length": 2**20 + 1}]}).encode(), JSON,
     413),
    ("POST", "/v1/arena/commit", b"[]", JSON, 422),
    ("POST", "/v1/arena/commit", json.dumps({"slots": [{"key": GOOD, "offset": 0, "length": 4,
                                                         "checksum": -1}]}).encode(), JSON, 422),
    ("POST", "/v1/arena/pin", b"not json at all", JSON, 422),
    ("POST", "/v1/arena/release", b'{"lease": 5}', JSON, 422),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), BAD_REQUESTS)
def test_bad_request_gets_a_json_error_and_commits_nothing(api, method, path, body, headers, status) -> None:
    answer = api.request(method, path, content=body, headers=headers)
    assert answer.status_code == status, answer.text
    if status != 404 or answer.headers["content-type"] == "application/json":
        assert answer.json()["error"], answer.text
    assert nothing_committed(api.get("/stats").json())
    assert api.put(f"/v1/chunks/{key(2, 'after')}", content=b"fine").status_code == 201  # still serving
    assert api.get(f"/v1/chunks/{key(2, 'after')}").content == b"fine"


def test_chunked_body_over_the_limit_is_refused(sidecar) -> None:
    url = sidecar.info["url"]

    def body():
        for _ in range(20):
            yield b"z" * 65536  # 1.25 MiB in all, without a Content-Length

    import urllib.request

    auth = write_auth(sidecar.info["arena_dir"])
    req = urllib.request.Request(f"{url}/v1/chunks/{GOOD}", data=body(), method="PUT", headers=auth)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 413 and json.loads(e.value.read())["error"]
    assert nothing_committed(SidecarClient(url).stats())
    still_serving(url)


def raw(port: int, head: bytes, body: bytes, close_write: bool) -> bytes:
    """Sends a hand-made request; returns whatever comes back before the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        else:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_lying_content_length_commits_nothing(sidecar) -> None:
    port, url = sidecar.info["port"], sidecar.info["url"]
    auth = auth_line(sidecar.info["arena_dir"])
    head = (
        f"PUT /v1/chunks/{GOOD} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/octet-stream\r\n"
        f"Content-Length: 100000\r\n\r\n"
    ).encode()
    answer = raw(port, head, b"only this much", close_write=True)  # says 100000, sends 14, then EOF
    assert answer == b"" or b" 400 " in answer.split(b"\r\n")[0]
    c = SidecarClient(url)
    wait_until(lambda: nothing_committed(c.stats()), 10, "the lying upload's reservation to be given back")
    assert c.lookup([GOOD]) == 0
    # a Content-Length larger than allowed is refused before any byte is read
    head = f"PUT /v1/chunks/{GOOD} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {2**30}\r\n\r\n".encode()
    answer = raw(port, head, b"tiny", close_write=True)
    assert b" 413 " in answer.split(b"\r\n")[0] and b'"error"' in answer
    assert nothing_committed(c.stats())
    still_serving(url)


def test_a_client_disconnecting_mid_upload_commits_nothing(sidecar) -> None:
    port, url = sidecar.info["port"], sidecar.info["url"]
    auth = auth_line(sidecar.info["arena_dir"])
    c = SidecarClient(url)
    for sent in (0, 1, 300_000):
        head = f"PUT /v1/chunks/{GOOD} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {2**20}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head + b"q" * sent)
            wait_until(lambda: c.stats()["reserved_chunks"] == 1, 10, "the upload to start")
        # closed mid-upload
        wait_until(lambda: nothing_committed(c.stats()), 10, "the broken upload's reservation to go")
        assert c.lookup([GOOD]) == 0
    still_serving(url)


def test_control_socket_bad_frames(sidecar) -> None:
    path = str(sidecar.info["arena_dir"] / "control.sock")

    def call(frame: bytes) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(frame)
            (n,) = struct.unpack(">I", s.recv(4))
            answer = b""
            while len(answer) < n:
                answer += s.recv(n - len(answer))
            return json.loads(answer)

    def frame(body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + body

    assert call(frame(b"{not json"))["status"] == 400
    assert call(frame(b"[" * 5000))["status"] == 400  # too deep for the JSON decoder
    assert call(frame(b"[1]"))["status"] == 400
    assert call(frame(json.dumps({"op": "explode", "body": {}}).encode()))["status"] == 404
    bad = call(frame(json.dumps({"op": "reserve", "body": {"items": [{"key": "XX", "length": 1}]}}).encode()))
    assert bad["status"] == 422 and bad["body"]["error"]
    big = call(
        frame(json.dumps({"op": "reserve", "body": {"items": [{"key": GOOD, "length": 2**21}]}}).encode())
    )
    assert big["status"] == 413
    assert call(struct.pack(">I", 2**31))["status"] == 413  # a frame larger than allowed
    # Frames over 64 KiB are decoded and answered off the event loop, with the same answers.
    assert call(frame(b"[" * 70000))["status"] == 400
    items = [{"key": f"{i:064x}", "length": 0} for i in range(65536)]  # the largest batch, one frame
    bad = call(frame(json.dumps({"op": "reserve", "body": {"items": [*items[:-1], {"key": "XX"}]}}).encode()))
    assert bad["status"] == 422 and bad["body"]["error"].startswith("items.65535.")
    whole = call(frame(json.dumps({"op": "reserve", "body": {"items": items}}).encode()))
    assert whole["status"] == 200 and all(s is not None for s in whole["body"]["slots"])
    SidecarClient(sidecar.info["url"]).abort([slot_from_json(s, 0) for s in whole["body"]["slots"]])
    assert nothing_committed(SidecarClient(sidecar.info["url"]).stats())
    still_serving(sidecar.info["url"])


def test_json_bodies_are_bounded_before_they_are_read(sidecar) -> None:
    """FastAPI reads a JSON body whole on the event loop before any schema limit: a 256 MiB one held
    lookups for 2 s. Now one over the control socket's frame limit is refused from its header, and
    one that does not declare its length is refused."""
    port, url = sidecar.info["port"], sidecar.info["url"]
    post = "POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = raw(port, f"{post}Content-Length: {256 << 20}\r\n\r\n".encode(), b'{"keys": [', close_write=True)
    assert answer.startswith(b"HTTP/1.1 413") and b"at most" in answer
    answer = raw(port, f"{post}Transfer-Encoding: chunked\r\n\r\n".encode(), b"4\r\n{}  \r\n0\r\n\r\n", True)
    assert answer.startswith(b"HTTP/1.1 411")
    assert SidecarClient(url, timeout=5).lookup([GOOD]) == 0  # and lookups are answered
    assert nothing_committed(SidecarClient(url).stats())
    still_serving(url)


def test_a_body_trickled_slower_than_its_lease_holds_no_room(tmp_path) -> None:
    """A PUT renews its reservation with each piece, but never past --lease-seconds from its start:
    four clients trickling a byte at a time held the whole arena for 48 s."""
    proc = start_sidecar(tmp_path, "64Ki", [], "--lease-seconds", "1")
    auth = auth_line(proc.info["arena_dir"])
    try:
        c = SidecarClient(proc.info["url"], timeout=5)
        with socket.create_connection(("127.0.0.1", proc.info["port"]), timeout=10) as s:
            s.sendall(
                f"PUT /v1/chunks/{GOOD} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 65536\r\n\r\n".encode()
            )
            s.sendall(b"t")
            wait_until(lambda: c.stats()["reserved_chunks"] == 1, 10, "the slow PUT's reservation")
            s.settimeout(0.2)
            answer = b""

            def trickle() -> bool:  # a byte per try, as a slow client sends them, until it is answered
                nonlocal answer
                try:
                    s.sendall(b"t")
                    answer += s.recv(65536)
                except (TimeoutError, BlockingIOError):
                    return False
                except (BrokenPipeError, ConnectionResetError):
                    return True
                return bool(answer)

            wait_until(trickle, 20, "the slow PUT answered")
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert c.stats()["reserved_chunks"] == 0 and c.stats()["free_bytes"] == 65536
        assert c.put(key(3, "after"), b"f" * 65536)  # the room is there for the next writer
    finally:
        proc.stop()


def test_slow_uploads_together_hold_at_most_half_the_arena(tmp_path) -> None:
    """Bodies streaming in hold their reservations until they end: a second upload that would take
    uploads past half the arena is refused at once, and the connector's saves keep their room."""
    proc = start_sidecar(tmp_path, "64Ki", [], "--lease-seconds", "30")
    auth = auth_line(proc.info["arena_dir"])
    try:
        c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(proc.info["arena_dir"]))
        with socket.create_connection(("127.0.0.1", proc.info["port"]), timeout=10) as s:
            s.sendall(
                f"PUT /v1/chunks/{GOOD} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 32768\r\n\r\nt".encode()
            )
            wait_until(lambda: c.stats()["reserved_chunks"] == 1, 10, "the slow upload's reservation")
            with pytest.raises(SidecarError, match="at most 32768 together"):
                c.put(key(4, "second"), b"s" * 16384)
            assert c.stats()["reserved_chunks"] == 1  # the refused one reserved nothing
            save(c, {key(4, "save"): b"v" * 16384})  # a connector's save (reserve, write, commit)
            assert load(c, [key(4, "save")]) == {key(4, "save"): b"v" * 16384}
        # the slow client went away: its room is back for the next upload
        wait_until(lambda: c.stats()["reserved_chunks"] == 0, 10, "the slow upload's reservation to go")
        assert c.put(key(4, "second"), b"s" * 16384)
        still_serving(proc.info["url"])
    finally:
        proc.stop()
