"""Which backend gets a request when the bridge knows where its prompt's KV is.

The lookup-server says, per kvmesh instance, how many leading tokens of the prompt it
holds (whole chunks). A backend whose hit is worth it (at least `min_tokens`) and
that is not much busier than the least loaded one (at most `max_extra_inflight` more
requests in flight) wins over the least loaded one: the longest hit first, then the
fewest requests in flight, then the least-loaded pick itself (so that ties keep its
round-robin). Otherwise the least loaded one gets it, as without a lookup.

Pure functions of the backends' state and one lookup answer: no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvmesh.services.bridge.backends import Backend

By = Literal["kv", "load"]


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """What the lookup-server answered for one prompt of `prompt_tokens` tokens."""

    prompt_tokens: int
    by_instance: Mapping[str, int] = field(default_factory=dict)

    def of(self, backend: Backend) -> int:
        """The cached prefix on that backend, in tokens (0 when it has no instance id)."""
        return self.by_instance.get(backend.instance_id, 0) if backend.instance_id else 0


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen backend; `by` "kv" when a cached prefix chose it, "load" when it is
    the least-loaded pick; `hit_tokens`, its cached prefix of the prompt."""

    backend: Backend
    by: By
    hit_tokens: int = 0


def choose(
    least: Backend,
    backends: Sequence[Backend],
    hits: PrefixHits | None,
    *,
    min_tokens: int,
    max_extra_inflight: int,
) -> Choice:
    """`least` is the pool's least-loaded pick (the answer without hits); `hits` None
    when there was no lookup (off, failed, skipped)."""
    if hits is None:
        return Choice(least, "load")
    cap = least.inflight + max_extra_inflight
    best: Backend | None = None
    best_key: tuple[int, int, bool] | None = None
    for b in backends:
        hit = hits.of(b)
        # An ejected backend (failing its requests) is no better for holding the KV; one
        # on probation takes one trial request at a time.
        if b.state == "down" or hit < min_tokens or b.inflight > cap or b.ejected():
            continue
        if b.trial_busy() and b is not least:
            continue
        key = (-hit, b.inflight, b is not least)
        if best_key is None or key < best_key:
            best, best_key = b, key
    if best is None:
        return Choice(least, "load", hits.of(least))
    return Choice(best, "kv", hits.of(best))


def whole_prompt_tokens(hits: PrefixHits, min_hit_tokens: int) -> int:
    """The hit at which a backend holds nearly the whole prompt: what it would still
    compute (prompt minus hit) is below `min_hit_tokens`, too little to be worth a
    prefill elsewhere. Never below min_hit_tokens itself."""
    return max(min_hit_tokens, hits.prompt_tokens - min_hit_tokens + 1)
