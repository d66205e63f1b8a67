"""Logging and metrics shared by every kvmesh process."""

from kvmesh.common.observability.logs import configure_logging, get_logger
from kvmesh.common.observability.metrics import Metrics, serve_metrics

__all__ = ["Metrics", "configure_logging", "get_logger", "serve_metrics"]
