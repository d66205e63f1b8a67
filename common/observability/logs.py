"""Structured logging: JSON lines on stderr through structlog, the same in every process.

Context bound with `structlog.contextvars.bind_contextvars` (request id, lookup id)
rides along on every line logged inside that context, so one id can be followed
across the services that handled it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(level: str = "info", *, json: bool = True, service: str = "kvmesh") -> None:
    """Set up structlog for this process; call once at process start (idempotent)."""
    try:
        numeric = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(_LEVELS)}") from None
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )

    def add_service(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        # A processor, not a bound contextvar: threads start with an empty context, so
        # a value bound at start-up would be missing from lines logged on other threads.
        event.setdefault("service", service)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard module end up on the same stream.
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s"
    )


def get_logger(name: str, **initial: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger that tags each line with the component name and any initial values."""
    return structlog.get_logger(logger_name=name, **initial)
