"""kvpool's Kubernetes operator: pools become cache sidecars, connector config, a Redis tier, status."""
