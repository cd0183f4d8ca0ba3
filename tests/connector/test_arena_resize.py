"""A sidecar restarted with another --capacity (the same arena directory): a worker that still maps
the old arena neither dies of SIGBUS on a copy in flight (a smaller arena) nor reads a short view
(a bigger one). Real sidecar processes; the worker's ArenaMapping."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from kvtest import start_sidecar

from kvpool_connector.arena_mapping import ArenaMapping
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.wire import ARENA_FILE

KEY = "ab" * 16
MiB = 1 << 20


def _put_last(url: str, data: bytes) -> None:
    c = SidecarClient(url, timeout=5)
    for i in range(7):  # the last one lands past the first MiB of the arena
        assert c.put(f"{i:02x}" * 16 if i < 6 else KEY, data)
    c.close()


def test_a_copy_in_flight_survives_a_restart_with_a_smaller_arena(tmp_path: Path) -> None:
    """The copy runs in a child process: SIGBUS would kill it, not the test."""
    child = textwrap.dedent(
        f"""
        import sys
        from kvpool_connector.arena_mapping import ArenaMapping
        from kvpool_sidecar.client import SidecarClient
        sys.path[:0] = [{str(Path(__file__).parent.parent)!r}, {str(Path(__file__).parent)!r}]
        from kvtest import start_sidecar
        from test_arena_resize import KEY, MiB, _put_last

        big = start_sidecar(__import__("pathlib").Path({str(tmp_path)!r}), "8Mi")
        port, arena_dir = big.info["port"], big.info["arena_dir"]
        _put_last(big.info["url"], b"q" * MiB)
        slot = SidecarClient(big.info["url"]).pin([KEY]).slots[0]
        mapping = ArenaMapping(lambda: str(arena_dir / "arena"))
        view = mapping.slot(slot.epoch, slot.offset, slot.length)  # a copy that goes on ...
        big.stop()
        small = start_sidecar(__import__("pathlib").Path({str(tmp_path)!r}), "1Mi", port=port)
        try:
            print("offset", slot.offset, "sum", int(view.sum()))  # ... after the restart
        finally:
            small.stop()
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    offset, total = done.stdout.split()[1], done.stdout.split()[3]
    assert int(offset) >= 6 * MiB and int(total) == ord("q") * MiB  # the bytes it was copying


def test_after_a_restart_with_a_bigger_arena_the_worker_maps_all_of_it(tmp_path: Path) -> None:
    small = start_sidecar(tmp_path, "1Mi")
    port, arena_dir = small.info["port"], small.info["arena_dir"]
    mapping = ArenaMapping(lambda: str(arena_dir / ARENA_FILE))
    c = SidecarClient(small.info["url"], timeout=5)
    assert c.put(KEY, b"s" * 4096)
    first = c.pin([KEY]).slots[0]
    assert bytes(mapping.slot(first.epoch, first.offset, first.length).numpy()) == b"s" * 4096
    small.stop()
    big = start_sidecar(tmp_path, "8Mi", port=port)
    try:
        _put_last(big.info["url"], b"b" * MiB)
        slot = SidecarClient(big.info["url"], timeout=5).pin([KEY]).slots[0]
        assert slot.offset >= 6 * MiB  # beyond the old arena's end
        assert bytes(mapping.slot(slot.epoch, slot.offset, slot.length).numpy()) == b"b" * MiB
    finally:
        big.stop()
