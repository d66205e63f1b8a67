"""The `kvmesh` command."""
