"""A schemathesis run over the real sidecar's OpenAPI: no generated request gets a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from kvtest import start_sidecar, write_auth
from schemathesis.checks import not_a_server_error

EXAMPLES_PER_OPERATION = 30  # bounded: the whole run takes well under a minute on 2 cores


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> Iterator:
    proc = start_sidecar(tmp_path_factory.mktemp("schemathesis"), "8Mi", [], "--max-chunk-bytes", "1Mi")
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


def test_no_server_errors(sidecar) -> None:
    schema = schemathesis.openapi.from_url(sidecar.info["url"] + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    auth = write_auth(sidecar.info["arena_dir"])  # so writes get past the token to their handlers
    assert len(operations) >= 12  # every route is in the schema, so every route is exercised

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            response = case.call(timeout=10, headers=auth)
            case.validate_response(response, checks=[not_a_server_error])

        run()
    assert sidecar.alive()
