"""What each vLLM engine of the pod said of itself at start (kvpool on or off, chunks shared or not),
for /stats and so for the pool's status. An engine reports only when it starts, so the reports are
kept beside the arena: a sidecar restarted under a running vLLM still knows them."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from kvpool_sidecar.side_files import remove_if_same, write_atomically

log = logging.getLogger(__name__)

ENGINES_FILE = "engines.json"
MAX_ENGINES = 64  # a pod runs a few (data parallel ranks); the oldest report goes first


class EngineReports:
    def __init__(self, directory: Path, mode: int) -> None:
        self.path = directory / ENGINES_FILE
        self.mode = mode
        self._inode, self.reports = _read_own(self.path)

    def put(self, engine: str, report: dict[str, Any]) -> None:
        self.reports.pop(engine, None)
        self.reports[engine] = report
        while len(self.reports) > MAX_ENGINES:
            del self.reports[next(iter(self.reports))]
        try:
            self._inode = write_atomically(self.path, json.dumps(self.reports).encode(), self.mode)
        except OSError as e:  # kept in memory still: only a restart would forget it
            log.warning("cannot keep the engines' reports in %s: %s", self.path, e)

    def remove(self) -> None:
        if self._inode is not None:
            remove_if_same(self.path, self._inode)


def _read_own(path: Path) -> tuple[int | None, dict[str, dict[str, Any]]]:
    """(inode, reports) a previous sidecar of this user kept; nothing from a file another user planted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 1 << 20:
            return None, {}
        with os.fdopen(os.dup(fd), "rb") as f:
            found = json.loads(f.read())
    except (OSError, ValueError):
        return None, {}
    finally:
        os.close(fd)
    if not isinstance(found, dict):
        return None, {}
    return st.st_ino, {str(k): v for k, v in found.items() if isinstance(v, dict)}
