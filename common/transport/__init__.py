"""Clients and channels that move bytes between processes (ZMQ, NIXL)."""
