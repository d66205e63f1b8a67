"""kvmesh's example plugin: an in-memory tier (`memdict`) and connector (`memkv://`)."""
