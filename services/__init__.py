"""The kvmesh services and the embedded worker engine."""
