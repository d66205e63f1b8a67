"""Structured logging: JSON lines on stderr through structlog, the same in every process.

Context bound with `structlog.contextvars.bind_contextvars` (request id, lookup id)
rides along on every line logged inside that context, so one id can be followed
across the services that handled it. Libraries that log through the standard
`logging` module (aiohttp, asyncio, pyzmq) are rendered the same way, a traceback
included, so every line of the stream is one JSON object.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(
    level: str = "info", *, json: bool = True, service: str = "kvmesh", libraries: bool = True
) -> None:
    """Set up structlog for this process; call once at process start (idempotent).

    libraries: also render the standard `logging` module's records (a process of our
    own). False in a host's process (vLLM's): its root logger, and what its other
    libraries and the host itself log, stay the host's."""
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

    stream = _OneLineAtATime(sys.stderr)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_service,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_args: _LineLogger(stream),
        cache_logger_on_first_use=False,
    )
    if libraries:
        _route_stdlib(numeric, shared, renderer, stream)


def _add_logger_name(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    record = event.get("_record")
    if record is not None:
        event.setdefault("logger_name", record.name)
    return event


class _OneLineAtATime:
    """A stream whose writes never interleave: structlog's lines and the stdlib
    handler's each came whole, but through two locks, and sys.stderr (a TextIOWrapper)
    is not thread-safe: to a pipe (a container's log), a library's line landed inside
    one of ours of 20 KB, two JSON objects on one line (64 of 6000 in a test).

    Reentrant: a signal handler or a __del__ that logs while its thread is inside a
    write must not wait on itself. Remade in a forked child, where a thread that held
    it at the fork no longer exists to let it go."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with _write_lock:
            return self._stream.write(text)

    def flush(self) -> None:
        with _write_lock:
            self._stream.flush()


class _LineLogger:
    """structlog's logger: one write a line under _write_lock alone (structlog's own
    WriteLogger takes a plain lock of its own first, neither reentrant nor remade
    after fork: the hangs _OneLineAtATime avoids came back through it)."""

    def __init__(self, stream: _OneLineAtATime) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        with _write_lock:
            self._stream.write(message + "\n")
            self._stream.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


_write_lock = threading.RLock()


def _new_write_lock() -> None:
    global _write_lock
    _write_lock = threading.RLock()


os.register_at_fork(after_in_child=_new_write_lock)


def _route_stdlib(level: int, shared: list[Any], renderer: Any, stream: Any) -> None:
    """Send the standard `logging` module's records (libraries) to stderr through the
    same processors: a plain "%(message)s" line, and a traceback on lines of its own,
    would break every JSON reader of the stream (`jq` stops at the first).

    Like logging.basicConfig, this installs a handler only on a root logger that has
    none (or has ours, from an earlier call): logging set up otherwise is kept."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, _MARK, False)]
    if root.handlers and not ours:
        return
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    if ours:
        handler = ours[0]
        handler.setStream(stream)
    else:
        handler = logging.StreamHandler(stream)
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    handler.setFormatter(formatter)
    root.setLevel(level)


_MARK = "_kvmesh_handler"


def get_logger(name: str, **initial: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger that tags each line with the component name and any initial values."""
    return structlog.get_logger(logger_name=name, **initial)
