"""`kvpool-sidecar` / `python -m kvpool_sidecar`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import uvloop

from kvpool_sidecar.server import serve
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.settings import parse_settings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sidecar = Sidecar.build(settings)
    uvloop.run(serve(sidecar))
