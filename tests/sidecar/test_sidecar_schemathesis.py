"""A schemathesis run over the sidecar's OpenAPI, served in this process: no generated request gets a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from kvtest import write_auth
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok

EXAMPLES_PER_OPERATION = 30  # bounded: the whole run takes well under a minute on 2 cores


def test_no_server_errors(api) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.app)
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"the sidecar's OpenAPI schema: {result.err()}"
        operations.append(result.ok())
    auth = write_auth(api.app.state.sidecar.settings.arena_dir)  # so writes get past the token
    assert len(operations) >= 12  # every route is in the schema, so every route is exercised

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            response = case.call(headers=auth)
            case.validate_response(response, checks=[not_a_server_error])

        run()
