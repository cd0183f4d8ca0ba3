"""The arena file and the control socket, made by the real sidecar process: never through a planted
symlink or hard link, group-only where the directory gives a shared group (a pod's fsGroup)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtest import start_sidecar
from sidecar_support import http_json, key, load, save

from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.wire import ARENA_HEADER_BYTES


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_planted_symlink_or_hard_link_is_replaced_never_written_through(tmp_path) -> None:
    arena_dir = tmp_path / "arena-1"
    arena_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (arena_dir / "arena").symlink_to(victim)
    linked = tmp_path / "linked"
    linked.write_bytes(b"")
    (arena_dir / "control.sock").hardlink_to(linked)  # the socket path is unlinked and made anew
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(arena_dir))
    try:
        assert victim.read_bytes() == b"precious"
        arena = arena_dir / "arena"
        assert stat.S_ISREG(arena.lstat().st_mode) and arena.stat().st_nlink == 1
        assert arena.stat().st_size == ARENA_HEADER_BYTES + 2**20  # a header page, then chunks
        assert stat.S_ISSOCK((arena_dir / "control.sock").lstat().st_mode)
        assert linked.read_bytes() == b""
    finally:
        proc.stop()
    # a hard link to another file (so a second name can read and write the arena): replaced too
    assert not (arena_dir / "arena").exists()  # removed at exit: no --keep-arena
    other = tmp_path / "other"
    other.write_bytes(b"\0" * 2**20)
    (arena_dir / "arena").hardlink_to(other)
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(arena_dir))
    try:
        c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(arena_dir))
        save(c, {key(1, "own"): b"\x42" * 4096})
        assert load(c, [key(1, "own")]) == {key(1, "own"): b"\x42" * 4096}
        assert other.read_bytes() == b"\0" * 2**20 and (arena_dir / "arena").stat().st_nlink == 1
    finally:
        proc.stop()


def test_files_are_group_only_where_their_users_share_a_group(tmp_path) -> None:
    fs_group, supplemental, private = tmp_path / "fsgroup", tmp_path / "supplemental", tmp_path / "private"
    for directory in (fs_group, supplemental, private):
        directory.mkdir()
    os.chmod(fs_group, 0o2770)  # what the kubelet makes of an emptyDir when the pod has an fsGroup
    for directory, flags, mode in (
        (fs_group, [], 0o660),
        (supplemental, ["--shared-group"], 0o660),  # what the operator injects
        (private, [], 0o600),  # no shared group: this user's only
    ):
        proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), *flags)
        try:
            assert _mode(directory / "arena") == mode
            assert _mode(directory / "control.sock") == mode
            assert _mode(directory / "write-token") == mode
        finally:
            proc.stop()


def test_without_a_shared_group_another_user_can_neither_write_the_arena_nor_reach_the_socket() -> None:
    """Whoever can write the arena or reach the control socket can plant a chunk that vLLM loads. In a
    directory every user can enter, only the files' modes keep another user out."""
    directory = Path(tempfile.mkdtemp(prefix="kvpool-modes-", dir="/dev/shm"))
    os.chmod(directory, 0o755)
    proc = start_sidecar(directory, "1Mi", [], "--arena-dir", str(directory))
    try:
        assert _as_nobody(f"open({str(directory / 'arena')!r}, 'r+b')") == "PermissionError"
        connect = f"__import__('socket').socket(1).connect({str(directory / 'control.sock')!r})"
        assert _as_nobody(connect) == "PermissionError"
    finally:
        proc.stop()
        shutil.rmtree(directory)


def test_http_writes_need_the_write_token_which_only_the_arenas_users_can_read() -> None:
    """The data API listens on loopback, which every user of a bare host reaches: without the token
    beside the arena, a PUT that vLLM would load is refused (on the code before it, one with no
    credentials was stored: 201). Reads need no token: they change nothing."""
    directory = Path(tempfile.mkdtemp(prefix="kvpool-token-", dir="/dev/shm"))
    os.chmod(directory, 0o755)
    proc = start_sidecar(directory, "1Mi", [], "--arena-dir", str(directory))
    url = proc.info["url"]
    try:
        assert _as_nobody(f"open({str(directory / 'write-token')!r})") == "PermissionError"
        planted = key(7, "planted")
        for auth in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": "Basic eDp5"}):
            status, answer = http_json(f"{url}/v1/chunks/{planted}", "PUT", b"\0" * 4096, auth)
            assert status == 401 and "write-token" in answer["error"], answer
        assert http_json(f"{url}/v1/arena/reserve", "POST", b'{"items": []}')[0] == 401
        assert http_json(f"{url}/v1/chunks/{planted}", "DELETE")[0] == 401
        assert http_json(f"{url}/v1/chunks/{planted}")[0] == 404  # nothing stored; reads need no token
        c = SidecarClient(url, timeout=5)  # a user who can read the token file, as vLLM can
        assert c.put(planted, b"own") and c.get(planted) == b"own"
    finally:
        proc.stop()
        shutil.rmtree(directory)


def test_a_client_reads_the_new_token_of_a_restarted_sidecar(tmp_path) -> None:
    """Each start writes a new token; a vLLM that outlives its sidecar's restart keeps writing."""
    directory = tmp_path / "kept"
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), "--keep-arena")
    try:
        c = SidecarClient(proc.info["url"], timeout=5)
        assert c.put(key(1, "before"), b"x")
        old = (directory / "write-token").read_text()
    finally:
        proc.stop()
    assert not (directory / "write-token").exists()
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), port=proc.info["port"])
    try:
        assert (directory / "write-token").read_text() != old
        assert c.put(key(2, "after"), b"y") and c.get(key(2, "after")) == b"y"
    finally:
        proc.stop()


def _as_nobody(statement: str) -> str:
    """Runs `statement` as uid/gid 65534 with Debian's python3 (which that user can run); the name of
    the exception it raised, or 'ok'."""
    code = f"try:\n    {statement}\n    print('ok')\nexcept Exception as e:\n    print(type(e).__name__)"
    argv = ["/usr/bin/python3", "-I", "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, user=65534, group=65534, cwd="/")
    return done.stdout.strip() or done.stderr


def test_an_arena_dir_that_is_a_symlink_is_refused(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    argv = [
        sys.executable,
        "-m",
        "kvpool_sidecar",
        "--arena-dir",
        str(tmp_path / "link"),
        "--capacity",
        "1Mi",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "not a symlink" in run.stderr and "Traceback" not in run.stderr
    assert not (real / "arena").exists()


def test_a_header_changed_behind_the_sidecar_reinitialises_the_arena_instead_of_offering(
    tmp_path,
) -> None:
    """A rogue writer (or memory corruption) changed the arena's header: clients would refuse every
    offset the sidecar hands out, so it must stop offering what it stored, say so, and serve anew."""
    proc = start_sidecar(tmp_path, "1Mi")
    arena_dir: Path = proc.info["arena_dir"]
    try:
        c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(arena_dir))
        chunks = {key(i, "hdr"): bytes([i]) * 4096 for i in range(3)}
        save(c, chunks)
        assert c.lookup(list(chunks)) == 3
        with (arena_dir / "arena").open("r+b") as f:
            f.seek(9)
            f.write(b"\xff")  # one byte of the epoch
        assert c.lookup(list(chunks)) == 0  # not offered: no client could load them
        stats = c.stats()
        assert stats["arena_reinitialised"] == 1 and stats["chunks"] == 0
        assert "header changed" in stats["arena_fault"]
        status, health = http_json(proc.info["url"] + "/healthz")
        assert status == 200 and "header changed" in health["arena_fault"]
        assert b"kvpool_arena_reinitialised_total 1" in http_json(proc.info["url"] + "/metrics")[1]
        save(c, chunks)  # under the new epoch, which the header says again
        assert load(c, list(chunks)) == chunks
        assert c.stats()["arena_reinitialised"] == 1
    finally:
        proc.stop()


def test_the_arena_file_goes_when_the_sidecar_stops_unless_it_is_kept(tmp_path) -> None:
    """On a bare host the arena's tmpfs pages stay allocated while its file exists. In a pod the
    operator passes --keep-arena: the emptyDir goes with the pod, and a restarted sidecar reuses it."""
    proc = start_sidecar(tmp_path, "1Mi")
    arena = proc.info["arena_dir"] / "arena"
    assert arena.exists()
    proc.stop()  # SIGTERM, as at a pod's deletion or a host's service stop
    assert not arena.exists()
    assert not (proc.info["arena_dir"] / "control.sock").exists()
    assert not (proc.info["arena_dir"] / "write-token").exists()
    kept = start_sidecar(tmp_path, "1Mi", [], "--keep-arena")
    kept.stop()
    assert (kept.info["arena_dir"] / "arena").exists()


def test_a_sidecar_restarted_under_a_running_vllm_still_knows_its_engines_reports(tmp_path) -> None:
    """An engine reports only at its own start: a sidecar restarted in the pod (--keep-arena) reads the
    reports kept beside the arena, so the pool's status does not forget that kvpool is off there."""
    directory = tmp_path / "kept"
    off = {"cache": "off", "shared": True, "reason": "MambaSpec", "model": "q"}
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), "--keep-arena")
    try:
        SidecarClient(proc.info["url"], timeout=5).report_engine("dp0", off)
        assert _mode(directory / "engines.json") == 0o600
    finally:
        proc.stop()
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory))
    try:
        assert SidecarClient(proc.info["url"], timeout=5).stats()["engines"] == {"dp0": off}
    finally:
        proc.stop()
    assert not (directory / "engines.json").exists()  # no --keep-arena: gone with the arena
