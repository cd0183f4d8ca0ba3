"""Listening sockets that serve IPv4 and IPv6 alike: an IPv6-only cluster probes the pod's IPv6
address, an IPv4 one its IPv4 address, and the same sidecar image runs in both."""

from __future__ import annotations

import socket

WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})  # "every address": both families


def listen_tcp(host: str, port: int) -> socket.socket:
    """A bound, listening, non-blocking socket. A wildcard host gets one dual-stack socket (IPv4 arrives
    as mapped addresses), or IPv4 alone on a kernel without IPv6."""
    if host in WILDCARDS:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            return _bind(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port))
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        return _bind(sock, ("::", port))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _bind(socket.socket(family, socket.SOCK_STREAM), (host, port))


def _bind(sock: socket.socket, address: tuple[str, int]) -> socket.socket:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
