"""The requests in flight through the bridge (GET /transfers, `kvmesh admin transfers`).

One entry per client request from the moment a decoder is chosen until its answer is
sent: the transfer id names the KV the prefiller pushes to the decoder, and the same
id is on every log line of that request, the prefiller's and decoder's included
(X-Request-Id).
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

Phase = Literal["prefill", "decode"]


class TransferInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One in-flight request as GET /transfers lists it. `prefiller` is "" when the
    request went to the decoder alone; `fallback` says why (e.g. "timeout").
    KV-aware routing: `route` says what chose the backend that computes the prompt
    (the prefiller, else the decoder): "kv" (its cached prefix, `hit_tokens` long) or
    "load" (the least loaded); `route_fallback`, why the lookup had no answer."""

    transfer_id: str
    endpoint: str
    prefiller: str
    decoder: str
    phase: Phase
    age_s: float
    stream: bool
    fallback: str = ""
    route: str = "load"
    hit_tokens: int = 0
    prompt_tokens: int = 0
    route_fallback: str = ""


class Transfer:
    def __init__(
        self, transfer_id: str, endpoint: str, prefiller: str, decoder: str, stream: bool
    ) -> None:
        self.transfer_id = transfer_id
        self.endpoint = endpoint
        self.prefiller = prefiller
        self.decoder = decoder
        self.stream = stream
        self.phase: Phase = "prefill" if prefiller else "decode"
        self.fallback = ""
        self.route = "load"
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.route_fallback = ""
        self.started = time.monotonic()

    def info(self, now: float) -> TransferInfo:
        return TransferInfo(
            transfer_id=self.transfer_id,
            endpoint=self.endpoint,
            prefiller=self.prefiller,
            decoder=self.decoder,
            phase=self.phase,
            age_s=round(now - self.started, 3),
            stream=self.stream,
            fallback=self.fallback,
            route=self.route,
            hit_tokens=self.hit_tokens,
            prompt_tokens=self.prompt_tokens,
            route_fallback=self.route_fallback,
        )


class TransferTable:
    def __init__(self) -> None:
        self._live: dict[str, Transfer] = {}

    def add(self, transfer: Transfer) -> Transfer:
        self._live[transfer.transfer_id] = transfer
        return transfer

    def remove(self, transfer_id: str) -> None:
        self._live.pop(transfer_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def snapshot(self) -> list[TransferInfo]:
        """Oldest first."""
        now = time.monotonic()
        return sorted((t.info(now) for t in self._live.values()), key=lambda i: -i.age_s)
