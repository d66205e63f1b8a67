"""kvmesh: a hierarchical KV-cache layer for LLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvmesh")
except PackageNotFoundError:  # running from a tree that was never installed
    __version__ = "0+unknown"
