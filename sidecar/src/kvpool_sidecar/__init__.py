"""kvpool's cache sidecar: a byte-capped KV chunk store with a shared-memory arena and a Redis tier."""

__version__ = "0.1.0"
