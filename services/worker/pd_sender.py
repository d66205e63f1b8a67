"""The prefiller's half of disaggregated prefill: push a prompt's KV to a decoder.

`push_layers` is a generator the vLLM worker steps once per layer, like
`KVEngine.store_layer`: each step copies that layer of every chunk out of the paged
KV into L1 buffers and hands it to a coroutine on the engine loop, which writes it
into the buffers the decoder allocated (one NIXL WRITE per layer, or a `PushChunks`
message over ZMQ). So layer i travels while the model computes layer i+1. The
allocation request goes out before layer 0 is copied. The last layer (or, without
layerwise, the whole chunks) is written in groups, and each group is committed (each
chunk's xxh3, which the decoder verifies) while the next group is written; the sender
hashes the groups, in order, while they are being written.

The worker waits for the commit, with the deadline `pd.timeout_s`, before vLLM
finishes the prefill step, so when the prefill's HTTP answer reaches the bridge the KV
is on the decoder (or the push failed, and the decoder will recompute). A push that
fails or is abandoned cancels its allocation on the decoder. The pushed chunks are
also stored in this engine's tiers, like any saved prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.common.chunk_codec import chunk_checksums, dtype_name
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel import PeerError, Piece, StuckTransfer, TransferChannel
from kvmesh.common.transport.chunk_regions import WHOLE, token_axis
from kvmesh.services.worker.layerwise import _drop

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

# The last write goes in up to this many groups, so the decoder verifies one group while
# the next is written.
GROUPS = 8
GROUP_BYTES = 16 << 20


@dataclass(frozen=True)
class PdTarget:
    """Where a prefill's KV goes: the decoder rank's P2P endpoint, under a transfer id
    the bridge also hands the decoder."""

    transfer_id: str
    endpoint: str


@dataclass
class _Entry:
    start: int
    end: int
    key: ChunkKey
    obj: MemoryObj
    fresh: bool  # copied from the paged KV now (else: already in L1)


class PdSender:
    def __init__(self, engine: KVEngine, channel: TransferChannel) -> None:
        self.engine = engine
        self.channel = channel
        self.timeout_s = engine.config.pd.timeout_s
        m = engine.stats.metrics
        pushes = m.counter("pd_pushes_total", "PD pushes to decoders", ["outcome"])
        self._pushes = {o: pushes.labels(outcome=o) for o in ("ok", "refused", "failed")}
        self._bytes = m.counter("pd_sent_bytes_total", "PD chunk bytes written to decoders")
        self._seconds = m.histogram(
            "pd_push_seconds", "From allocation request to commit reply, per push"
        )
        self._bytes.inc(0)
        self.inflight = 0

    async def run(self, push: _Push) -> int:
        """The loop side of one push; the tokens the decoder committed."""
        self.inflight += 1
        t0 = time.perf_counter()
        try:
            tokens = await push.run()
        except PeerError as exc:
            refused = exc.code == proto.ErrorCode.NO_ROOM
            self._pushes["refused" if refused else "failed"].inc()
            log.warning("PD push failed", transfer=push.target.transfer_id, error=str(exc))
            if not isinstance(exc, StuckTransfer):
                # Else the WRITE may still land: the decoder's buffers are left to its
                # expiry rather than freed now for someone else's chunk.
                await push.cancel()
            return 0
        except BaseException as exc:
            self._pushes["failed"].inc()
            if not isinstance(exc.__cause__, StuckTransfer):  # as above
                await push.cancel()
            raise
        finally:
            self.inflight -= 1
        self._pushes["ok"].inc()
        self._bytes.inc(push.sent_bytes)
        self._seconds.observe(time.perf_counter() - t0)
        return tokens


class _Push:
    """One push's state on the engine loop."""

    def __init__(self, sender: PdSender, target: PdTarget, entries: list[_Entry]) -> None:
        self.sender = sender
        self.target = target
        self.entries = entries
        self.deadline = time.monotonic() + sender.timeout_s
        self.layers: asyncio.Queue[int | None] = asyncio.Queue()
        self.alloc_id = 0
        self.sent_bytes = 0

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PeerError(f"PD push {self.target.transfer_id} past its deadline")
        return left

    async def run(self) -> int:
        e = self.sender.engine
        ch = self.sender.channel
        first = self.entries[0].obj
        last = self.entries[-1]
        full = list(e.layout.chunk_shape(e.config.chunk_size))
        axis = token_axis(e.chunk_format)
        unix_deadline = time.time() + self._left()
        reply = await ch.call(
            self.target.endpoint,
            lambda rid: proto.AllocChunks(
                rid,
                proto.PROTOCOL_VERSION,
                self.target.transfer_id,
                [x.key.to_str() for x in self.entries],
                full,
                dtype_name(first.dtype),
                int(first.fmt),
                int(last.obj.shape[axis]),
                unix_deadline,
            ),
            self._left(),
        )
        if not isinstance(reply, proto.AllocChunksReply) or len(reply.slots) != len(self.entries):
            raise PeerError(f"unexpected reply to alloc: {type(reply).__name__}")
        self.alloc_id = reply.alloc_id
        pieces = []
        for i, (x, slot) in enumerate(zip(self.entries, reply.slots, strict=True)):
            if slot.have:
                continue
            if slot.nbytes != x.obj.nbytes:
                raise PeerError(f"decoder buffer of {slot.nbytes} bytes for {x.obj.nbytes}")
            pieces.append((i, x.obj, slot.addr))
        last_layer = e.layout.num_layers - 1
        commits: list[asyncio.Task[proto.Reply]] = []
        hashing: asyncio.Task[None] | None = None
        ended = False
        try:
            while True:
                layer = await asyncio.wait_for(self.layers.get(), self._left())
                if layer is None:
                    break
                if layer not in (last_layer, WHOLE):
                    if pieces:
                        await ch.write(
                            self.target.endpoint,
                            reply.alloc_id,
                            layer,
                            pieces,
                            self._left(),
                            agent=reply.agent,
                        )
                    continue
                # Every byte is in place: write the rest in groups, back to back, each
                # committed (and verified by the decoder) while the next is written. The
                # chunks are hashed meanwhile, group by group, so a group's checksums are
                # ready when its write ends instead of being computed after it.
                groups = _groups(pieces)
                sums = [asyncio.get_running_loop().create_future() for _ in groups]
                hashing = asyncio.create_task(_hash_groups(groups, sums))

                def written(
                    i: int,
                    groups: list[Sequence[Piece]] = groups,
                    sums: list[asyncio.Future[None]] = sums,
                ) -> None:
                    if not ended:  # a write that outlived its push commits nothing
                        commits.append(
                            asyncio.create_task(self._commit(reply.alloc_id, groups[i], sums[i]))
                        )

                await ch.write_groups(
                    self.target.endpoint,
                    reply.alloc_id,
                    layer,
                    groups,
                    self._left(),
                    written,
                    agent=reply.agent,
                )
            if not pieces:  # the decoder had every chunk: commit holds them for us
                commits.append(asyncio.create_task(self._commit(reply.alloc_id, [])))
            done = await asyncio.wait_for(asyncio.gather(*commits), self._left())
        finally:
            ended = True
            for task in commits:
                task.cancel()
            if hashing is not None:
                hashing.cancel()
        self.alloc_id = 0  # committed: nothing left to cancel
        self.sent_bytes = sum(obj.nbytes for _, obj, _ in pieces)
        rejected = 0
        for answer in done:
            if not isinstance(answer, proto.CommitChunksReply):
                raise PeerError(f"unexpected reply to commit: {type(answer).__name__}")
            rejected += answer.rejected
        if rejected:
            raise PeerError(f"decoder rejected {rejected} chunks (checksum)")
        return self.entries[-1].end

    async def _commit(
        self, alloc_id: int, group: Sequence[Piece], hashed: asyncio.Future[None] | None = None
    ) -> proto.Reply:
        """Commit the group's chunks with their checksums, once hashed says they are on
        the chunks."""
        if hashed is not None:
            await hashed
        return await self.sender.channel.call(
            self.target.endpoint,
            lambda rid: proto.CommitChunks(
                rid,
                proto.PROTOCOL_VERSION,
                alloc_id,
                [int(obj.checksum or 0) for _, obj, _ in group],
                [i for i, _, _ in group],
            ),
            self._left(),
        )

    async def cancel(self) -> None:
        if not self.alloc_id:
            return
        alloc_id, self.alloc_id = self.alloc_id, 0
        try:
            await self.sender.channel.call(
                self.target.endpoint,
                lambda rid: proto.CancelChunks(rid, proto.PROTOCOL_VERSION, alloc_id),
                1.0,
            )
        except PeerError as exc:  # it frees the buffers at its deadline anyway
            log.debug("PD cancel not delivered", error=str(exc))


async def _hash_groups(groups: Sequence[Sequence[Piece]], sums: list[asyncio.Future[None]]) -> None:
    """Put each chunk's xxh3 on it (once: a chunk that has one keeps it), group by
    group in write order, resolving sums[i] when group i is done. It leaves a core to
    the copy that runs meanwhile."""
    threads = max(1, (os.cpu_count() or 1) - 1)
    try:
        for group, done in zip(groups, sums, strict=True):
            unsummed = [obj for _, obj, _ in group if obj.checksum is None]
            if unsummed:
                digests = await chunk_checksums(unsummed, max_threads=threads)
                for obj, digest in zip(unsummed, digests, strict=True):
                    obj.checksum = digest
            if not done.done():
                done.set_result(None)
    except asyncio.CancelledError:
        for done in sums:
            done.cancel()
        raise
    except Exception as exc:  # the commits waiting on it fail the push: a recompute
        for done in sums:
            if not done.done():
                done.set_exception(PeerError(f"hashing the chunks failed: {exc!r}"))


def _groups(pieces: Sequence[Piece]) -> list[Sequence[Piece]]:
    """Up to GROUPS groups of at least GROUP_BYTES (each write and commit has a fixed
    cost: small transfers go whole)."""
    if not pieces:
        return []
    total = sum(obj.nbytes for _, obj, _ in pieces)
    count = max(1, min(GROUPS, total // GROUP_BYTES, len(pieces)))
    bounds = [len(pieces) * i // count for i in range(count + 1)]
    return [pieces[a:b] for a, b in itertools.pairwise(bounds)]


def push_layers(
    engine: KVEngine,
    tokens: Sequence[int] | torch.Tensor,
    slot_mapping: torch.Tensor,
    mask: torch.Tensor | None,
    target: PdTarget,
    tenant: str = "",
    *,
    layerwise: bool = True,
) -> Generator[int, None, int]:
    """Push the chunks of tokens (from mask's first True on) to target; next() after
    each layer's KV is in the paged cache. Returns the tokens the decoder committed
    (0 when the push failed: the decoder then recomputes). Without layerwise, the
    first next() copies and pushes every layer at once."""
    sender = engine.pd_sender
    if sender is None:
        engine._check_open()
        raise RuntimeError("this engine has no PD sender (engine.pd.role)")
    # Allocating and reading L1 take pages of the pool: close() waits for this step as
    # for a store. The copies of the later steps go into the tensor views taken here.
    engine._enter()
    entries: list[_Entry] = []
    try:
        l1 = engine.storage.l1
        for start, end, key in engine.chunks(tokens, mask, tenant):
            obj = l1.get(key)
            fresh = obj is None
            if obj is None:
                obj = engine._new_chunk_obj_or_stop(end - start, "PD push truncated")
                if obj is None:
                    break
            entries.append(_Entry(start, end, key, obj, fresh))
        loop = engine.loop
        if entries and loop.stopping:
            # The engine is closing (its loop stopped or stopping): no push can run, so
            # the decoder recomputes; a push submitted to a loop that cannot stop waited
            # out the whole PD deadline.
            _drop(engine, [x.obj for x in entries])
            entries = []
        if not entries:
            return 0
        # asyncio.Queue binds to a loop on first use: built here, used on the engine loop.
        push = _Push(sender, target, entries)
        try:
            fut: concurrent.futures.Future[int] = loop.submit(sender.run(push))
        except RuntimeError:
            if not loop.stopping:
                raise
            _drop(engine, [x.obj for x in entries])  # it stopped since the check above
            return 0
        fresh = [x for x in entries if x.fresh]
        spans = [(x.start, x.end) for x in fresh]
        outs = [x.obj.tensor for x in fresh]
    except BaseException:
        _drop(engine, [x.obj for x in entries])
        raise
    finally:
        engine._exit()

    def feed(item: int | None) -> None:
        # Once the engine is closed its loop is stopped (or stopping): the sender was
        # cancelled there, and the closed loop would raise into the inference thread.
        if engine.closed:
            return
        try:
            loop.loop.call_soon_threadsafe(push.layers.put_nowait, item)
        except RuntimeError:
            if not loop.stopping:
                raise

    committed = False
    try:
        num_layers = engine.layout.num_layers
        if layerwise:
            for layer in range(num_layers):
                if fresh:  # one copier call a layer for every chunk
                    engine.copier.gather_chunks(slot_mapping, spans, outs, layer)
                feed(layer)
                if layer < num_layers - 1:
                    yield layer
        else:
            if fresh:
                engine.copier.gather_chunks(slot_mapping, spans, outs)
            feed(WHOLE)
        feed(None)
        try:
            pushed = fut.result(sender.timeout_s + 1.0)
        except (concurrent.futures.TimeoutError, PeerError) as exc:
            log.warning("PD push gave up", transfer=target.transfer_id, error=repr(exc))
            fut.cancel()
            pushed = 0
        except concurrent.futures.CancelledError:
            if not loop.stopping:
                raise
            pushed = 0  # the engine closed: its loop's stop cancelled the push
        try:
            engine._enter()  # close() waits for a commit under way
        except RuntimeError:
            # Closed between two layers: its tiers are gone, so nothing is stored here.
            _drop(engine, [x.obj for x in entries])
        else:
            try:
                # What was copied out is cached here too, like any saved prompt.
                for x in entries:
                    if x.fresh:
                        x.obj.key = x.key
                        if engine.storage.put(x.key, x.obj):
                            engine.stats.chunks_stored.inc()
                    else:
                        x.obj.ref_down()
            finally:
                engine._exit()
        committed = True
        return pushed
    finally:
        if not committed:  # abandoned part way: cancel, and the buffers go back
            fut.cancel()
            _drop(engine, [x.obj for x in entries])
