"""Polling a condition in a test, with a deadline and a message saying what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 5.0, what: str = "condition") -> T:
    """cond()'s first truthy value, polled until timeout; AssertionError otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.02)
