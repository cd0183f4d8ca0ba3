"""`kvpool-sidecar` / `python -m kvpool_sidecar`."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvloop

from kvpool_sidecar.server import serve
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.settings import parse_settings

log = logging.getLogger("kvpool_sidecar")


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        sidecar = Sidecar.build(settings)
    except OSError as e:  # e.g. the arena does not fit the volume: say so plainly, exit non-zero
        log.error("kvpool-sidecar cannot start: %s", e)
        sys.exit(1)
    uvloop.run(serve(sidecar))
