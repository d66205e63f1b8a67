"""A tier plugin whose factory hangs, for tests/integration/test_left_items.py: it
waits until the test sets RELEASE (as a plugin stuck connecting to a store that never
answers would)."""

from __future__ import annotations

import threading
from typing import Any

from kvmesh_example_plugin.tier import MemDictTier

RELEASE = threading.Event()
CLOSED: list[str] = []  # names of tiers whose close() ran
WAIT_S = 60.0


class HangingTier(MemDictTier):
    def close(self) -> None:
        CLOSED.append(self.name)
        super().close()


def make_tier_slowly(context: Any) -> HangingTier:
    RELEASE.wait(WAIT_S)
    return HangingTier(context)
