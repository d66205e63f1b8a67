"""ConfigError: what is wrong with a config, which key, and which layer set it.

A user fixing a config needs three things: the key, where its value came from (a file
line, an environment variable, an override, or the default), and the rule it broke.
Every message this package raises carries all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Source(NamedTuple):
    """Where a value came from: ``kind`` is default, file, env or override."""

    kind: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.where}" if self.where else self.kind


DEFAULT = Source("default")


class ConfigIssue(NamedTuple):
    """One problem: `key` is dotted (``engine.l1.max_size``), empty for whole-file ones."""

    key: str
    source: Source
    problem: str

    def __str__(self) -> str:
        if not self.key:
            return f"{self.source}: {self.problem}"
        return f"{self.key}: {self.problem} (from {self.source})"


class ConfigError(ValueError):
    """The configuration is invalid; `issues` lists every problem found before stopping."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        if not issues:
            raise ValueError("ConfigError needs at least one issue")
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))

    @property
    def key(self) -> str:
        """The dotted key of the first issue."""
        return self.issues[0].key

    @property
    def source(self) -> Source:
        """Where the value of the first issue came from."""
        return self.issues[0].source
