"""The decoder's half of disaggregated prefill: receive buffers a prefiller writes into.

A prefiller asks (`AllocChunks`, over the P2P endpoint) for one buffer per chunk of a
prompt. The receiver takes free L1 pages only: it never evicts to make room, so a
decoder busy with its own cache refuses (`NO_ROOM`) and the request falls back to
recompute rather than slowing down everything else. The prefiller then writes each
layer straight into the buffers (a NIXL WRITE, or `PushChunks` frames over ZMQ) and
finally sends `CommitChunks` with each chunk's xxh3: chunks that verify enter L1 under
their keys, pinned under the lookup id "pd:<transfer id>" until the decoder's vLLM has
loaded them (the connector releases that id when the request finishes) or
`pd.hold_s` passes. Then the chunks received are dropped from L1 (once no other
transfer of the same prefix holds them): a decoder stores no KV of its own, so kept
chunks would only fill the free pages later transfers need.

Buffers that are never committed (a prefiller that died, a cancelled request) go back
to the pool after the sender's deadline plus `pd.timeout_s`: a late NIXL write can then
no longer land in a page that holds someone else's chunk.

Everything here runs on the engine's event loop (the P2P server calls it), but for the
copies of large pushed frames, which run on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.common import offload
from kvmesh.common.chunk_codec import chunk_checksums, dtype_name
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj, MemoryObjFreedError
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.chunk_regions import layer_regions, token_axis
from kvmesh.services.worker.events import KVEventKind
from kvmesh.services.worker.pins import LookupPins

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

PIN_PREFIX = "pd:"
# What a peer may make the receiver keep (the PD share bounds pages only, and an
# allocation of chunks already here takes none): allocations in flight plus transfers
# held, and the chunk keys they list. Beyond either, an allocation is refused (NO_ROOM:
# the prompt is recomputed).
MAX_TRANSFERS = 4096
MAX_KEYS_TRACKED = 64 * proto.MAX_KEYS
MAX_TRANSFER_ID = 128  # what the connector sends: [\w.-]{1,128}


def hold_id(transfer_id: str) -> str:
    """The lookup id the received chunks of a transfer are pinned under."""
    return PIN_PREFIX + transfer_id


class PdRefused(Exception):
    """An AllocChunks the receiver will not serve; `code` goes back to the sender."""

    def __init__(self, code: proto.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Inbound:
    transfer_id: str
    keys: list[ChunkKey]
    objs: list[MemoryObj | None]  # None: the chunk is here already, nothing to write
    expires: float  # monotonic
    pending: set[int]  # indices of the buffers awaiting their commit
    have: list[ChunkKey]  # the chunks here already, pinned until the last commit or the end


class PdReceiver:
    def __init__(self, engine: KVEngine) -> None:
        self.engine = engine
        cfg = engine.config.pd
        self.grace_s = cfg.timeout_s
        self.max_pages = max(1, int(engine.pool.num_pages * cfg.max_receive_fraction))
        self._inbound: dict[int, _Inbound] = {}
        # lookup id → (keys pinned for it, the received chunks it is a holder of)
        self._held: dict[str, tuple[list[ChunkKey], set[ChunkKey]]] = {}
        # A chunk received over PD → how many held transfers hold it (transfers of one
        # prefix share chunks): it leaves L1 when the last one ends. At 0 it is in
        # _orphans, a removal a pin refused (a lookup of vLLM's), retried by sweep.
        self._owners: dict[ChunkKey, int] = {}
        self._orphans: set[ChunkKey] = set()
        self._keys = 0  # keys listed by the allocations in flight and the transfers held
        # Apart from lookups' pins: a decode may wait in vLLM's queue far longer than a
        # lookup waits for its retrieve.
        self.pins = LookupPins(engine.storage.unpin, cfg.hold_s)
        self._pages = 0
        m = engine.stats.metrics
        allocs = m.counter("pd_receive_allocs_total", "PD allocation requests", ["outcome"])
        self._allocs = {o: allocs.labels(outcome=o) for o in ("ok", "refused")}
        self._committed = m.counter("pd_received_chunks_total", "PD chunks received and verified")
        self._rejected = m.counter(
            "pd_rejected_chunks_total", "PD chunks dropped: checksum mismatch or never written"
        )
        self._bytes = m.counter("pd_received_bytes_total", "PD chunk bytes committed")
        self._expired = m.counter("pd_expired_allocs_total", "PD allocations freed uncommitted")
        self._inflight = m.gauge("pd_receive_inflight", "PD allocations awaiting their commit")
        self._inflight_pages = m.gauge("pd_receive_pages", "L1 pages held by PD receive buffers")
        self._holding = m.gauge(
            "pd_transfers_held", "PD transfers received and pinned until their decode ends"
        )
        for c in (self._committed, self._rejected, self._bytes, self._expired):
            c.inc(0)
        self._gauges()

    # -- requests (on the engine loop) ----------------------------------------------------
    def alloc(self, msg: proto.AllocChunks, agent: str = "") -> proto.AllocChunksReply:
        """Receive buffers for msg's chunks, or PdRefused. agent: this engine's NIXL
        agent, named in the reply ("" for ZMQ)."""
        try:
            reply = self._alloc(msg, agent)
        except PdRefused:
            self._allocs["refused"].inc()
            raise
        self._allocs["ok"].inc()
        return reply

    def _alloc(self, msg: proto.AllocChunks, agent: str) -> proto.AllocChunksReply:
        e = self.engine
        if not msg.keys:
            raise PdRefused(proto.ErrorCode.BAD_MESSAGE, "no keys")
        if not 0 < len(msg.transfer_id) <= MAX_TRANSFER_ID:
            raise PdRefused(proto.ErrorCode.BAD_MESSAGE, "transfer id empty or too long")
        if not math.isfinite(msg.deadline):  # NaN would never expire
            raise PdRefused(proto.ErrorCode.BAD_MESSAGE, f"deadline {msg.deadline}")
        keys = _parse_keys(msg.keys)
        if len(set(keys)) != len(keys):
            raise PdRefused(proto.ErrorCode.BAD_MESSAGE, "duplicate keys")
        try:
            fmt: MemoryFormat | None = MemoryFormat(msg.fmt)
        except ValueError:
            fmt = None
        full = tuple(e.layout.chunk_shape(e.config.chunk_size))
        if (
            fmt != e.chunk_format
            or tuple(msg.chunk_shape) != full
            or msg.dtype != dtype_name(e.layout.dtype)
        ):
            raise PdRefused(
                proto.ErrorCode.BAD_LAYOUT,
                f"chunks of {msg.chunk_shape} {msg.dtype} fmt {msg.fmt} do not fit this "
                f"engine's {list(full)} {dtype_name(e.layout.dtype)} fmt {int(e.chunk_format)}",
            )
        if not 0 < msg.last_tokens <= e.config.chunk_size:
            raise PdRefused(proto.ErrorCode.BAD_MESSAGE, f"last_tokens {msg.last_tokens}")
        if len(self._inbound) + len(self._held) >= MAX_TRANSFERS:
            raise PdRefused(
                proto.ErrorCode.NO_ROOM,
                f"{len(self._inbound)} allocations and {len(self._held)} transfers held",
            )
        if self._keys + len(keys) > MAX_KEYS_TRACKED:
            raise PdRefused(
                proto.ErrorCode.NO_ROOM, f"{self._keys} keys tracked, {len(keys)} more asked"
            )
        l1 = e.storage.l1
        # A chunk answered `have` stays pinned until the commit holds it: dropped or
        # evicted in between, the commit would report a chunk the decoder lacks.
        have = [l1.contains(k, pin=True) for k in keys]
        deadline = _monotonic_deadline(msg.deadline, e.config.pd.timeout_s)
        inbound = _Inbound(
            msg.transfer_id,
            keys,
            [None] * len(keys),
            deadline + self.grace_s,
            set(),
            [k for k, h in zip(keys, have, strict=True) if h],
        )
        self._keys += len(keys)
        try:
            need = len(keys) - len(inbound.have)
            if self._pages + need > self.max_pages:
                raise PdRefused(
                    proto.ErrorCode.NO_ROOM,
                    f"{need} pages asked, {self.max_pages - self._pages} of the PD share free",
                )
            axis = token_axis(e.chunk_format)
            for i, h in enumerate(have):
                if h:
                    continue
                shape = list(full)
                if i == len(keys) - 1:
                    shape[axis] = msg.last_tokens
                obj = e.pool.allocate(shape, e.layout.dtype, e.chunk_format)
                if obj is None:  # the pool itself is full: refuse rather than evict
                    raise PdRefused(proto.ErrorCode.NO_ROOM, "L1 has no free page")
                inbound.objs[i] = obj
                inbound.pending.add(i)
                self._pages += 1
        except BaseException:  # a refusal, or a failure of the pool: nothing kept
            self._free(inbound)
            raise
        alloc_id = self._new_alloc_id()
        self._inbound[alloc_id] = inbound
        self._gauges()
        slots = [
            proto.Slot(0, 0, True) if o is None else proto.Slot(o.data_ptr, o.nbytes, False)
            for o in inbound.objs
        ]
        return proto.AllocChunksReply(msg.rid, alloc_id, slots, agent)

    async def push(self, msg: proto.PushChunks, payloads: Sequence[memoryview]) -> proto.Reply:
        """Write frames sent over ZMQ (the NIXL channel writes without asking). Every
        frame is checked before any byte is written."""
        inbound = self._get(msg.alloc_id)
        if len(msg.chunks) != len(payloads):
            raise PdRefused(
                proto.ErrorCode.BAD_MESSAGE,
                f"{len(payloads)} frames for {len(msg.chunks)} chunks",
            )
        copies: list[_Copy] = []
        for index, frame in zip(msg.chunks, payloads, strict=True):
            if not 0 <= index < len(inbound.objs):
                raise PdRefused(proto.ErrorCode.BAD_MESSAGE, f"chunk index {index}")
            obj = inbound.objs[index]
            if obj is None:
                continue
            if index not in inbound.pending:  # committed: it may be in L1 already
                raise PdRefused(proto.ErrorCode.BAD_MESSAGE, f"chunk {index} is committed")
            try:
                regions = layer_regions(obj, msg.layer)
            except ValueError as exc:
                raise PdRefused(proto.ErrorCode.BAD_MESSAGE, str(exc)) from None
            if len(frame) != sum(n for _, n in regions):
                raise PdRefused(
                    proto.ErrorCode.BAD_MESSAGE,
                    f"chunk {index} layer {msg.layer}: {len(frame)} bytes for "
                    f"{sum(n for _, n in regions)}",
                )
            copies.append(_Copy(obj, obj.raw.numpy(), regions, frame))
        if sum(len(c.frame) for c in copies) < offload.OFFLOAD_FROM:
            _write_regions(copies)
        else:
            await _write_regions_off_loop(copies)
        return proto.PushChunksReply(msg.rid, len(msg.chunks))

    async def commit(self, msg: proto.CommitChunks) -> proto.CommitChunksReply:
        inbound = self._get(msg.alloc_id)
        indices = list(msg.chunks) if msg.chunks else sorted(inbound.pending)
        if len(msg.checksums) != len(indices):
            raise PdRefused(
                proto.ErrorCode.BAD_MESSAGE,
                f"{len(msg.checksums)} checksums for {len(indices)} chunks",
            )
        if len(set(indices)) != len(indices) or not inbound.pending.issuperset(indices):
            raise PdRefused(proto.ErrorCode.BAD_MESSAGE, "chunks not awaiting a commit")
        # From here on these buffers are ours to place (expiry and cancel skip them).
        inbound.pending.difference_update(indices)
        self._pages -= len(indices)
        have: list[ChunkKey] = []
        if not inbound.pending:  # the last commit also holds (takes the pins of) the `have`s
            del self._inbound[msg.alloc_id]
            self._keys -= len(inbound.keys)
            have, inbound.have = inbound.have, []
        todo = [(i, inbound.objs[i], s) for i, s in zip(indices, msg.checksums, strict=True)]
        # While the sender is still writing the next group (a copy that keeps one core
        # busy), hash on one thread beside it rather than on every core.
        objs: list[MemoryObj] = [o for _, o, _ in todo]  # type: ignore[misc]
        sums = await chunk_checksums(objs, max_threads=1 if inbound.pending else 0)
        l1 = self.engine.storage.l1
        events = self.engine.events
        committed = corrupt = gone = 0
        present: list[ChunkKey] = []  # each pinned once, for the hold
        for (i, obj, checksum), got in zip(todo, sums, strict=True):
            assert obj is not None
            if got != checksum:
                corrupt += 1
                obj.ref_down()
                continue
            key = inbound.keys[i]
            obj.checksum = checksum
            obj.key = key
            nbytes = obj.nbytes
            obj.pin()  # before it is in L1: nothing evicts it before the hold
            if l1.insert(key, obj):
                events.record(KVEventKind.STORED, key.to_str(), l1.name)
                self._owners.setdefault(key, 0)
            elif not l1.pin(key):  # the copy that was here has just gone
                gone += 1
                continue
            committed += 1
            self._bytes.inc(nbytes)
            present.append(key)
        rejected = corrupt + gone
        self._committed.inc(committed)
        self._rejected.inc(rejected)
        if corrupt:
            log.warning("PD chunks failed their checksum", transfer=inbound.transfer_id, n=corrupt)
        if gone:
            log.info(
                "PD chunks gone from L1 before their commit", transfer=inbound.transfer_id, n=gone
            )
        if present or have:
            # Not for a commit that kept nothing (every chunk corrupt): an empty hold
            # would count as a transfer held until pd.hold_s, one of MAX_TRANSFERS.
            self._hold(inbound.transfer_id, present + have)
        self._gauges()
        return proto.CommitChunksReply(msg.rid, committed, rejected)

    def cancel(self, msg: proto.CancelChunks) -> proto.CancelChunksReply:
        inbound = self._inbound.pop(msg.alloc_id, None)
        if inbound is not None:
            self._free(inbound)
        return proto.CancelChunksReply(msg.rid, inbound is not None)

    # -- housekeeping -----------------------------------------------------------------
    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        gone = [a for a, inbound in self._inbound.items() if inbound.expires < now]
        for alloc_id in gone:
            inbound = self._inbound.pop(alloc_id)
            log.warning("PD receive buffers freed uncommitted", transfer=inbound.transfer_id)
            self._expired.inc()
            self._free(inbound)
        return len(gone)

    def close(self) -> None:
        self.pins.release_all()
        for alloc_id in list(self._inbound):
            self._free(self._inbound.pop(alloc_id))

    @property
    def inflight(self) -> int:
        return len(self._inbound)

    @property
    def pages(self) -> int:
        return self._pages

    # -- helpers ------------------------------------------------------------------------
    def _new_alloc_id(self) -> int:
        """Random, not counted: a prefiller whose push began before this process
        (re)started reconnects to it and goes on naming the allocation the old one gave
        it; a counted id would be one handed out here too, and its writes, commit or
        cancel would land in another push. Never 0 (the sender's "none")."""
        while True:
            alloc_id = secrets.randbits(63)
            if alloc_id and alloc_id not in self._inbound:
                return alloc_id

    def _get(self, alloc_id: int) -> _Inbound:
        inbound = self._inbound.get(alloc_id)
        if inbound is None:
            raise PdRefused(
                proto.ErrorCode.UNKNOWN_TRANSFER, f"allocation {alloc_id} unknown or expired"
            )
        return inbound

    def _free(self, inbound: _Inbound) -> None:
        """End an allocation its sender will not (fully) commit."""
        l1 = self.engine.storage.l1
        for key in inbound.have:
            l1.unpin(key)
        inbound.have = []
        for i in inbound.pending:
            obj = inbound.objs[i]
            assert obj is not None
            obj.ref_down()
        self._pages -= len(inbound.pending)
        inbound.pending.clear()
        self._keys -= len(inbound.keys)
        self._gauges()

    def _hold(self, transfer_id: str, keys: list[ChunkKey]) -> None:
        """Hold keys (each pinned once by the caller) under the transfer's lookup id, with
        what earlier commits of the same transfer (one per prefill step) hold; the
        transfer becomes a holder of those received over PD."""
        l1 = self.engine.storage.l1
        lookup_id = hold_id(transfer_id)
        old, owned = self._held.get(lookup_id, ([], set()))
        self._keys -= len(old)
        if lookup_id not in self.pins:
            old = []
        # hold() replaces the id's entry and unpins the old keys once: pin them again.
        keys = [k for k in old if l1.pin(k)] + keys
        self.pins.hold(lookup_id, [(l1, k) for k in keys])
        for key in keys:
            if key in self._owners and key not in owned:
                owned.add(key)
                self._owners[key] += 1
                self._orphans.discard(key)
        self._held[lookup_id] = (keys, owned)
        self._keys += len(keys)

    def drop(self, lookup_id: str) -> int:
        """The transfer's chunks are loaded (or never will be): drop from L1 those
        received over PD that no other transfer holds."""
        # A commit that came after release() pinned them again: the decode is over.
        self.pins.release(lookup_id)
        entry = self._held.pop(lookup_id, None)
        if entry is None:
            return 0
        self._keys -= len(entry[0])
        dropped = 0
        for key in entry[1]:
            self._owners[key] -= 1
            if not self._owners[key]:
                dropped += self._remove(key)
        self._gauges()
        return dropped

    def _remove(self, key: ChunkKey) -> int:
        """Remove a received chunk no transfer holds; one still pinned waits for sweep."""
        l1 = self.engine.storage.l1
        removed = l1.remove(key)
        if not removed and l1.contains(key):
            self._orphans.add(key)
            return 0
        del self._owners[key]
        self._orphans.discard(key)
        if removed:
            self.engine.events.record(KVEventKind.REMOVED, key.to_str(), l1.name)
        return int(removed)

    def sweep(self) -> int:
        """Drop the transfers whose hold ended without a release (`pd.hold_s`), and the
        received chunks a pin kept from being removed."""
        self.pins.expire()
        dropped = sum(self.drop(i) for i in [i for i in self._held if i not in self.pins])
        return dropped + sum(self._remove(k) for k in list(self._orphans))

    def release(self, lookup_id: str) -> None:
        """The decode of a transfer ended (any thread): unpin and drop its chunks."""
        self.pins.release(lookup_id)
        loop = self.engine.loop
        if loop.running:
            loop.loop.call_soon_threadsafe(self.drop, lookup_id)

    def _gauges(self) -> None:
        self._inflight.set(len(self._inbound))
        self._inflight_pages.set(self._pages)
        self._holding.set(len(self._held))


@dataclass
class _Copy:
    obj: MemoryObj
    dst: np.ndarray  # obj's bytes: a view that keeps the pool's memory alive
    regions: list[tuple[int, int]]  # (offset, bytes) in obj, filled in order from frame
    frame: memoryview


def _write_regions(copies: Sequence[_Copy]) -> None:
    for c in copies:
        src = np.frombuffer(c.frame, dtype=np.uint8)
        pos = 0
        for off, n in c.regions:
            c.dst[off : off + n] = src[pos : pos + n]
            pos += n


async def _write_regions_off_loop(copies: Sequence[_Copy]) -> None:
    """Copy on a thread: megabytes of frames would hold the engine loop for
    milliseconds. Each buffer keeps a reference until its copy has ended, so an expiry or
    a cancel meanwhile cannot hand the page to another chunk while it is written."""
    for c in copies:
        c.obj.ref_up()

    def release(_: object = None) -> None:
        for c in copies:
            with contextlib.suppress(MemoryObjFreedError):  # the pool closed meanwhile
                c.obj.ref_down()

    copying = asyncio.ensure_future(asyncio.to_thread(_write_regions, copies))
    copying.add_done_callback(release)
    await asyncio.shield(copying)


def _parse_keys(raw: list[str]) -> list[ChunkKey]:
    try:
        return [ChunkKey.from_str(k) for k in raw]
    except ValueError as exc:
        raise PdRefused(proto.ErrorCode.BAD_KEY, str(exc)) from None


def _monotonic_deadline(unix_deadline: float, default_s: float) -> float:
    now = time.monotonic()
    if unix_deadline <= 0:
        return now + default_s
    return now + min(max(unix_deadline - time.time(), 0.0), 10 * default_s)
