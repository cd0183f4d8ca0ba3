"""The harness's service network takes a burst of connections as kube-proxy would: the API server dials
it without blocking, so a full listen backlog is a refused webhook call (EAGAIN), and the pod is
admitted without its cache (failurePolicy Ignore). 20 replicas created at once did that in CI."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from kubeharness.servicenet import ServiceNetwork

BURST = 64  # connections dialled at once, as the API server's webhook calls for a scaled Deployment


def test_a_burst_of_non_blocking_connects_is_never_refused(tmp_path: Path) -> None:
    net = ServiceNetwork(None, tmp_path / "service-network.sock").start()
    with contextlib.ExitStack() as stack:
        stack.callback(net.stop)
        refused = 0
        for _ in range(BURST):  # faster than the accepting thread gets the GIL
            s = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            s.setblocking(False)  # as Go dials
            try:
                s.connect(str(net.socket_path))
            except BlockingIOError:
                refused += 1
        assert refused == 0, f"{refused} of {BURST} connects refused: the listen backlog is too short"
