"""The sidecar's HTTP routes, one router per resource, over the Sidecar found by dependency injection."""
