"""KVEngine: store, retrieve and look up the KV of token sequences for one worker rank.

The engine is called synchronously from the inference engine's thread. L1 work
happens inline on that thread; lower tiers, pin expiry and prefetch run on the
engine's own event loop (LoopThread). A cache failure is never an inference
failure: store is best effort, and retrieve loads the longest prefix it can verify.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

import torch

from kvmesh.common.codecs import codec_from_config
from kvmesh.common.config import (
    ConfigError,
    ConfigIssue,
    EngineConfig,
    RuleError,
    Source,
    TierPluginConfig,
)
from kvmesh.common.keys import ChunkKey, KeyNamespace
from kvmesh.common.memory import HostMemoryPool, MemoryFormat, MemoryObj
from kvmesh.common.observability import get_logger, serve_metrics
from kvmesh.common.plugins import PluginError
from kvmesh.common.tokendb import ChunkedTokenDatabase
from kvmesh.common.transport.channel import TransferChannel, make_channel
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.gpu_ext import make_copier
from kvmesh.services.worker import layerwise
from kvmesh.services.worker.compress import CompressResult, rewrite_chunks
from kvmesh.services.worker.engine_health import engine_health
from kvmesh.services.worker.events import KVEventBuffer, KVEventKind
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.mla import MLABroadcast
from kvmesh.services.worker.p2p_server import attach_p2p_server
from kvmesh.services.worker.pd_receiver import PIN_PREFIX as PD_HOLD_PREFIX
from kvmesh.services.worker.pd_receiver import PdReceiver
from kvmesh.services.worker.pd_sender import PdSender
from kvmesh.services.worker.peer_locator import PeerLocator
from kvmesh.services.worker.pins import LookupPins
from kvmesh.services.worker.stats import EngineStats
from kvmesh.services.worker.storage_manager import StorageManager
from kvmesh.services.worker.tenants import TenantDatabases
from kvmesh.services.worker.tiers.base import Tier
from kvmesh.services.worker.tiers.disk import DiskTier
from kvmesh.services.worker.tiers.host import AllocationError, HostTier
from kvmesh.services.worker.tiers.p2p import P2PTier
from kvmesh.services.worker.tiers.plugin import TierContext, make_plugin_tier
from kvmesh.services.worker.tiers.remote import RemoteTier
from kvmesh.services.worker.tiers.remote_connector import make_connector

log = get_logger(__name__)

Tokens = Sequence[int] | torch.Tensor
Chunk = tuple[int, int, ChunkKey]

# The longest close() waits on a store's allocation (alloc_timeout_s may be infinite).
_CLOSE_ALLOC_WAIT_S = 30.0


def _check_rank_ports(config: EngineConfig, rank: int, world_size: int, on_gpu: bool) -> None:
    """ConfigError when the listeners of this host's ranks would share a port, or go
    past 65535: the config alone cannot see it, not knowing the world size. The ranks
    on a host are taken as the run of `on_host` ranks holding this one (at most its
    GPUs; on CPU, every rank): ranks on other hosts meet none of its ports."""
    on_host = max(1, min(world_size, torch.cuda.device_count()) if on_gpu else world_size)
    try:
        config.check_rank_ports(on_host, first=rank - rank % on_host)
    except RuleError as e:
        where = Source("engine start", f"rank {rank} of {world_size}")
        raise ConfigError([ConfigIssue(f"engine.{e.field}", where, str(e))]) from None


class KVEngine:
    """The cache of one (instance id, rank): build it with `get_or_create_engine`."""

    def __init__(
        self,
        instance_id: str,
        rank: int,
        config: EngineConfig,
        kv_caches: Sequence[torch.Tensor] | torch.Tensor | dict[str, torch.Tensor],
        *,
        world_size: int = 1,
        lower_tiers: Sequence[Tier] = (),
        mla_group: object | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        _check_rank_ports(config, rank, world_size, on_gpu=torch.cuda.is_initialized())
        self.instance_id = instance_id
        # CURVE keys (security config) for every socket the engine opens; None = off.
        self.curve = curve
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self._lock = threading.Lock()
        self._closed = False
        # Stores and retrieves running on callers' threads: close() waits for them to
        # end before the pool goes, since they read and write its pages.
        self._active = 0
        self._idle = threading.Condition(self._lock)
        self._frozen = False
        # Set by the controller client: who holds a prefix in their L1 (the P2P tier asks).
        self.peer_locator: PeerLocator | None = None
        # Where this engine serves its L1 to peers ("" when P2P is off).
        self.p2p_endpoint: str = ""
        # Where this engine answers lookups ("" until attach_lookup_server binds).
        self.lookup_endpoint: str = ""

        self.copier = make_copier(kv_caches)
        self.layout = self.copier.layout
        self._chunk_shapes: dict[int, torch.Size] = {}
        self.is_mla = self.layout.is_mla
        self.chunk_format = MemoryFormat.KV_MLA if self.is_mla else MemoryFormat.KV_2LTD
        self.namespace = KeyNamespace(
            model=config.model_name,
            kv_layout=self.layout.chunk_format_name,
            dtype=str(self.layout.dtype).removeprefix("torch."),
            # MLA KV is the same on every rank: one namespace lets rank 0 serve all.
            world_size=1 if self.is_mla else world_size,
            rank=0 if self.is_mla else rank,
            tenant=config.tenant_salt,
        )
        self.tokendb = ChunkedTokenDatabase(
            self.namespace,
            chunk_size=config.chunk_size,
            save_unfull_chunk=config.keys_partial_chunk,
            hash_algorithm=config.hash_algorithm,
        )
        self.tenants = TenantDatabases(self.tokendb)
        self._close_hooks: list[Callable[[], None]] = []

        page = self.layout.chunk_nbytes(config.chunk_size)
        self.pool = HostMemoryPool(
            int(config.l1.max_size), page_size=page, reserve_bytes=int(config.l1.reserve)
        )
        self.events = KVEventBuffer()
        self.loop = LoopThread(name=f"kvmesh-engine-{instance_id}-{rank}")
        lower: list[Tier] = list(lower_tiers)
        # MLA ranks other than 0 store nothing: they get their KV from rank 0.
        with_disk = config.disk.enabled and not (self.is_mla and rank != 0)
        with_remote = config.remote.enabled and not (self.is_mla and rank != 0)
        with_p2p = config.p2p.enabled
        pd_role = config.pd.role
        names = [HostTier.name, *(["p2p"] if with_p2p else [])]
        names += ["disk"] if with_disk else []
        names += [t.name for t in lower]
        plugin_tiers = config.tiers if not (self.is_mla and rank != 0) else []
        names += [t.tier_name for t in plugin_tiers]
        names += ["remote"] if with_remote else []
        self.stats = EngineStats(instance_id, rank, names)
        l1 = HostTier(
            self.pool,
            policy=config.l1.eviction_policy,
            alloc_timeout_s=config.l1.alloc_timeout_s,
            on_evict=self._on_evict,
            metrics=self.stats.metrics,
        )
        if with_disk:
            # L3 comes before the tiers passed in (remote ones, slower than a local disk).
            lower.insert(0, self._make_disk_tier())
        try:
            # Plugin tiers: after the disk, before the remote tier, in config order.
            lower += [self._make_plugin_tier(t) for t in plugin_tiers]
            if with_remote:
                # L4, the slowest: after the local disk and any tiers passed in.
                lower.append(self._make_remote_tier())
        except PluginError:
            # A startup error, not a half-built engine: nothing may keep running.
            for tier in lower:
                tier.close()
            self.loop.stop()
            raise
        channel = self._make_channel() if with_p2p or pd_role != "none" else None
        if with_p2p:
            assert channel is not None
            lower.insert(0, self._make_p2p_tier(channel))  # L2: a peer's memory beats any disk
        self.storage = StorageManager(
            l1, lower, self.loop, self.events, max_inflight_io=config.max_inflight_io
        )
        self.stats.l1_capacity.set(self.pool.capacity_bytes)
        # Read at each scrape: L1 also changes where no store passes (loads promoted
        # from lower tiers, evictions, PD receipts), and a gauge set only at stores
        # read 0 while L1 held chunks reloaded from disk.
        self.stats.l1_used.set_function(lambda: self.pool.used_bytes)
        self.stats.l1_chunks.set_function(lambda: len(self.storage.l1))
        # Disaggregated prefill: a decoder receives through its P2P endpoint; a
        # prefiller writes through the same channel.
        self.pd_receiver = PdReceiver(self) if pd_role in ("receiver", "both") else None
        self.pd_sender = (
            PdSender(self, channel)
            if channel is not None and pd_role in ("sender", "both")
            else None
        )
        if channel is not None and (with_p2p or self.pd_receiver is not None):
            attach_p2p_server(self, channel)
        self.pins = LookupPins(self.storage.unpin, config.pin_timeout_s)
        if config.metrics_port:
            # Rank r on port + r: every worker of a host has its own endpoint.
            metrics = serve_metrics(
                self.stats.metrics,
                config.metrics_port + rank,
                config.metrics_host,
                health=lambda: engine_health(self),
            )
            # Hooks run last-added first: stop serving, then free the port (shutdown()
            # alone leaves the listening socket bound).
            self.add_close_hook(metrics.server_close)
            self.add_close_hook(metrics.shutdown)
        self._mla = MLABroadcast(mla_group, rank) if self.is_mla and world_size > 1 else None
        self._prefetches: dict[str, concurrent.futures.Future[int]] = {}
        # Each running prefetch's token: it holds its pins only while still the one
        # wanted under its lookup id. Checked and released under _prefetch_lock, so a
        # release_lookup racing its end never leaves its pins behind.
        self._prefetch_tokens: dict[str, object] = {}
        self._prefetch_lock = threading.Lock()
        self.loop.submit(self._expire_pins_forever())
        log.info(
            "engine started",
            instance=instance_id,
            rank=rank,
            namespace=self.namespace.ns_id,
            model=self.namespace.model,
            l1_bytes=self.pool.capacity_bytes,
            page_bytes=self.pool.page_size,
            mla=self.is_mla,
        )
        if config.controller.enabled:
            # Last, so it registers what was built above (a P2P endpoint included).
            # Imported here: engines without a controller never load its client.
            from kvmesh.services.worker.controller_client import start_controller_client

            start_controller_client(self)

    def _make_disk_tier(self) -> DiskTier:
        """The L3 tier in `<disk.path>/<namespace id>/`, sharing the engine's metrics."""
        cfg = self.config.disk
        return DiskTier(
            Path(cfg.path) / self.namespace.ns_id,
            int(cfg.max_size),
            io_threads=cfg.io_threads,
            o_direct=cfg.o_direct,
            eviction_policy=cfg.eviction_policy,
            retry_s=cfg.retry_s,
            max_pending_puts=cfg.max_pending_puts,
            metrics=self.stats.metrics,
            codec=codec_from_config(cfg.compression, cfg.cachegen),
            # A file claiming more than a page (damaged, or of another layout) could
            # never be read back: the re-index leaves it out.
            max_chunk_bytes=self.pool.page_size,
        )

    def _make_plugin_tier(self, cfg: TierPluginConfig) -> Tier:
        context = TierContext(
            name=cfg.tier_name,
            instance_id=self.instance_id,
            rank=self.rank,
            namespace_id=self.namespace.ns_id,
            chunk_bytes=self.pool.page_size,
            loop=self.loop,
            metrics=self.stats.metrics,
            options=cfg.options,
        )
        tier = make_plugin_tier(cfg, context)
        log.info("plugin tier loaded", tier=tier.name, plugin=cfg.plugin)
        return tier

    def _make_remote_tier(self) -> RemoteTier:
        """The L4 tier on the engine's loop, chosen by `remote.url`; it closes (on the
        loop) before the loop stops."""
        cfg = self.config.remote
        connector = make_connector(
            cfg.url,
            key_prefix=cfg.key_prefix,
            timeout_s=cfg.timeout_s,
            curve=self.curve,
            connector=cfg.connector,
        )
        tier = RemoteTier(connector, self.loop, cfg, metrics=self.stats.metrics)
        self.add_close_hook(tier.close)
        return tier

    def _make_channel(self) -> TransferChannel:
        """The TransferChannel of peers and PD pushes: NIXL registers the whole L1 pool
        once, both to serve it and to land chunks in it. It closes (on the loop) before
        the loop stops."""
        buf = self.pool.buffer
        name = f"{self.instance_id}-{self.rank}"
        channel = make_channel(
            self.config.p2p.channel,
            name,
            [(buf.data_ptr(), buf.numel())],
            curve=self.curve,
            idle_s=self.config.p2p.peer_idle_s,
        )

        def close() -> None:
            if self.pd_receiver is not None and self.loop.running:
                self.loop.loop.call_soon_threadsafe(self.pd_receiver.close)
            try:
                if self.loop.running:
                    self.loop.run(channel.aclose(), 5.0)
            except Exception as exc:
                log.warning("channel close failed", error=repr(exc))

        self.add_close_hook(close)
        return channel

    def _make_p2p_tier(self, channel: TransferChannel) -> P2PTier:
        """L2: peers' L1 through the engine's channel, which also serves ours."""
        return P2PTier(
            channel,
            self.loop,
            self.config.p2p,
            lambda: self.peer_locator,
            lambda: self.p2p_endpoint,
            metrics=self.stats.metrics,
        )

    # -- bookkeeping ------------------------------------------------------------------
    def _on_evict(self, key: ChunkKey, obj: MemoryObj) -> None:
        self.stats.evictions["l1"].inc()
        self.events.record(KVEventKind.REMOVED, key.to_str(), "l1")

    async def _expire_pins_forever(self) -> None:
        period = max(0.05, min(1.0, self.config.pin_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                self.pins.expire()
                if self.pd_receiver is not None:
                    self.pd_receiver.expire()
                    self.pd_receiver.sweep()
                self.stats.pinned_lookups.set(len(self.pins))
            except Exception:
                # One bad pass must not end the task: no pin would ever expire again.
                log.exception("pin expiry pass failed")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.instance_id}/{self.rank} is closed")

    def _enter(self) -> None:
        """Count a store or retrieve in; RuntimeError once the engine is closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"engine {self.instance_id}/{self.rank} is closed")
            self._active += 1

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active and self._closed:  # only close() waits on it
                self._idle.notify_all()

    def _wait_idle(self, timeout: float) -> bool:
        """Wait for the stores and retrieves in flight to end; False if some still run."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._active, timeout)

    @staticmethod
    def _check_slots(tokens: Tokens, slot_mapping: torch.Tensor) -> None:
        # The copier moves only the slots it is given: with too few, a stored chunk's
        # tail would be a reused page's old bytes, and a load would report unwritten
        # tokens as loaded.
        if slot_mapping.numel() < len(tokens):
            raise ValueError(
                f"slot_mapping has {slot_mapping.numel()} slots for {len(tokens)} tokens: "
                "it needs one slot per token"
            )

    def register_kv_caches(
        self, kv_caches: Sequence[torch.Tensor] | torch.Tensor | dict[str, torch.Tensor]
    ) -> None:
        """Point the engine at (new) paged KV tensors of the same shape of chunk."""
        copier = make_copier(kv_caches)
        if copier.layout.chunk_format_name != self.layout.chunk_format_name or (
            copier.layout.dtype != self.layout.dtype
        ):
            raise ValueError(
                "new KV caches hold another kind of chunk "
                f"({copier.layout.chunk_format_name}/{copier.layout.dtype} vs "
                f"{self.layout.chunk_format_name}/{self.layout.dtype})"
            )
        self.copier = copier
        self.layout = copier.layout
        self._chunk_shapes = {}

    def chunks(
        self, tokens: Tokens, mask: torch.Tensor | None = None, tenant: str = ""
    ) -> list[Chunk]:
        """(start, end, key) per chunk; a tenant keys them in its own namespace."""
        return list(self.tenants.get(tenant).process_tokens(tokens, mask))

    def _chunk_shape(self, num_tokens: int) -> torch.Size:
        """layout.chunk_shape, one Size object per token count: the pool knows a shape
        it saw last by identity, and comparing Sizes is cheaper than building tuples."""
        shape = self._chunk_shapes.get(num_tokens)
        if shape is None:
            shape = torch.Size(self.layout.chunk_shape(num_tokens))
            self._chunk_shapes[num_tokens] = shape
        return shape

    def _new_chunk_obj(self, num_tokens: int) -> MemoryObj:
        """A page for one chunk, evicting or waiting as L1 allows; AllocationError
        when none frees up in time."""
        return self.storage.l1.allocate(
            self._chunk_shape(num_tokens), self.layout.dtype, self.chunk_format
        )

    def _new_chunk_obj_or_stop(self, num_tokens: int, stopping: str) -> MemoryObj | None:
        """`_new_chunk_obj`, or None (counted in `alloc_failures_total`, logged as
        `stopping`) for a caller that stops at the first chunk without a page."""
        try:
            return self._new_chunk_obj(num_tokens)
        except AllocationError as exc:
            self.stats.alloc_failures.inc()
            log.warning(f"{stopping}: no memory", error=str(exc))
            return None

    def _stores_here(self) -> bool:
        return not self._frozen and not (self.is_mla and self.rank != 0)

    # -- store ------------------------------------------------------------------------
    def store(
        self,
        tokens: Tokens,
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        tenant: str = "",
    ) -> int:
        """Copy the KV of tokens' full chunks out of the paged cache into the cache.

        slot_mapping has one slot per token; mask's leading False entries mark a prefix
        that is already cached (a multiple of the chunk size). Returns tokens stored.
        """
        self._check_slots(tokens, slot_mapping)
        self._enter()
        try:
            return self._store(tokens, slot_mapping, mask, tenant)
        finally:
            self._exit()

    def _store(
        self, tokens: Tokens, slot_mapping: torch.Tensor, mask: torch.Tensor | None, tenant: str
    ) -> int:
        t0 = time.perf_counter()
        self.stats.requests["store"].inc()
        self.stats.tokens_requested["store"].inc(len(tokens))
        if not self._stores_here():
            self.stats.stores_skipped.inc()
            return 0
        chunks = self.chunks(tokens, mask, tenant)
        held = self.storage.l1.held([key for _, _, key in chunks])
        todo = [chunk for chunk, h in zip(chunks, held, strict=True) if not h]
        objs = self._allocate_run(chunks, held, todo)
        if objs is None:
            # Too little can be evicted now (pages in use, or a prompt larger than L1):
            # one chunk at a time, each inserted before the next is allocated so that
            # it, too, can be evicted, waiting for pages as needed.
            stored = self._store_each(chunks, slot_mapping)
        else:
            stored = self._store_run(chunks, held, objs, slot_mapping)
        self._account_store(stored, t0)
        return stored

    def _allocate_run(
        self, chunks: list[Chunk], held: list[bool], todo: list[Chunk]
    ) -> list[MemoryObj] | None:
        """An object per chunk of todo (the chunks not held), evicting for all of them at
        once when L1 is full (the steady state), or None when that much cannot be freed
        now. The held chunks are never the ones evicted."""
        objs = self._allocate_free(todo)
        if objs is None and self.storage.l1.make_room(
            len(todo), [key for (_, _, key), h in zip(chunks, held, strict=True) if h]
        ):
            objs = self._allocate_free(todo)
        return objs

    def _allocate_free(self, todo: list[Chunk]) -> list[MemoryObj] | None:
        """An object per chunk of todo from free pages, or None when too few are free."""
        if not todo:
            return []
        l1, dtype, fmt = self.storage.l1, self.layout.dtype, self.chunk_format
        first, last = todo[0][1] - todo[0][0], todo[-1][1] - todo[-1][0]
        # Every chunk is full but perhaps the last.
        n_full = len(todo) if first == last else len(todo) - 1
        objs = l1.allocate_free(n_full, self._chunk_shape(first), dtype, fmt)
        if objs is None or n_full == len(todo):
            return objs
        tail = l1.allocate_free(1, self._chunk_shape(last), dtype, fmt)
        if tail is None:
            self.pool.release_batch(objs)
            return None
        return objs + tail

    def _store_run(
        self,
        chunks: list[Chunk],
        held: list[bool],
        objs: list[MemoryObj],
        slot_mapping: torch.Tensor,
    ) -> int:
        """Copy into objs (one per chunk not held, in one copier call) and put them,
        with the touches of the held chunks, in one pass over L1. A copy that raises
        still stores the chunks before it, as one call per chunk would; the rest of
        objs go back to the pool."""
        todo = [i for i, h in enumerate(held) if not h]
        copied = len(objs)
        try:
            if objs:
                self.copier.gather_chunks(
                    slot_mapping,
                    [(chunks[i][0], chunks[i][1]) for i in todo],
                    [obj.tensor for obj in objs],
                )
        except BaseException as exc:
            copied = getattr(exc, "chunks_done", 0)  # the copier's count of complete ones
            raise
        finally:
            if copied < len(objs):
                self.pool.release_batch(objs[copied:])
            # Up to the first chunk not copied: the held ones before it are touched.
            limit = todo[copied] if copied < len(objs) else len(chunks)
            run: list[MemoryObj | None] = []
            j = 0
            for (_, _, key), h in zip(chunks[:limit], held, strict=False):
                if h:
                    run.append(None)
                else:
                    obj = objs[j]
                    obj.key = key
                    run.append(obj)
                    j += 1
            added = self.storage.put_run([key for _, _, key in chunks[:limit]], run)
            stored = 0
            n_added = 0
            j = 0
            for (start, end, _), obj in zip(chunks, run, strict=False):
                if obj is not None:
                    if added[j]:
                        stored += end - start
                        n_added += 1
                    j += 1
            if n_added:
                self.stats.chunks_stored.inc(n_added)
        return stored

    def _store_each(self, chunks: list[Chunk], slot_mapping: torch.Tensor) -> int:
        stored = 0
        l1 = self.storage.l1
        for start, end, key in chunks:
            if self._closed:
                break  # close() waits for this store: no more pages
            if l1.contains(key):
                l1.touch(key)
                continue
            if (obj := self._new_chunk_obj_or_stop(end - start, "store stopped")) is None:
                break
            try:
                self.copier.gather(slot_mapping[start:end], obj.tensor)
            except BaseException:
                obj.ref_down()  # never inserted: its page would leak
                raise
            obj.key = key
            if self.storage.put(key, obj):
                stored += end - start
                self.stats.chunks_stored.inc()
        return stored

    def _account_store(self, stored: int, t0: float) -> None:
        self.stats.tokens_stored.inc(stored)
        self.stats.latency["store"].observe(time.perf_counter() - t0)

    # -- lookup -----------------------------------------------------------------------
    def lookup(
        self,
        tokens: Tokens,
        lookup_id: str | None = None,
        pin: bool = True,
        *,
        tenant: str = "",
    ) -> int:
        """How many leading tokens the cache holds. With a lookup id and pin, what was
        counted stays until the matching retrieve, `release_lookup`, or the pin timeout."""
        self._check_open()
        t0 = time.perf_counter()
        self.stats.requests["lookup"].inc()
        self.stats.tokens_requested["lookup"].inc(len(tokens))
        chunks = self.chunks(tokens, tenant=tenant)
        keys = [key for _, _, key in chunks]
        do_pin = pin and lookup_id is not None
        n, per_tier, pinned = self.storage.prefix_hits(keys, pin=do_pin)
        if do_pin:
            if pinned:
                self.pins.hold(lookup_id, pinned)
            else:
                # Nothing counted, nothing to hold: an entry would only sit in
                # `pinned_lookups` until pin_timeout_s. A repeated lookup that now
                # misses lets go of what its earlier one pinned, as hold() would.
                self.pins.release(lookup_id)
        hit = chunks[n - 1][1] if n else 0
        by_tier: dict[str, int] = {}
        first = 0
        for tier, count in per_tier:
            last = first + count
            by_tier[tier.name] = chunks[last - 1][1] - chunks[first][0]
            first = last
        self.stats.record_lookup(len(tokens), by_tier)
        self.stats.latency["lookup"].observe(time.perf_counter() - t0)
        return hit

    def release_lookup(self, lookup_id: str) -> None:
        """Drop the pins of a lookup whose request will not be retrieved."""
        with self._prefetch_lock:
            self._prefetch_tokens.pop(lookup_id, None)
            fut = self._prefetches.pop(lookup_id, None)
        # After the token went: a prefetch that held its pins just before is released
        # here, one ending later sees it is no longer wanted and unpins them itself.
        self.pins.release(lookup_id)
        if self.pd_receiver is not None and lookup_id.startswith(PD_HOLD_PREFIX):
            self.pd_receiver.release(lookup_id)
        if fut is not None:
            fut.cancel()

    # -- retrieve ---------------------------------------------------------------------
    def retrieve(
        self,
        tokens: Tokens,
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        lookup_id: str | None = None,
        *,
        tenant: str = "",
    ) -> torch.Tensor:
        """Load the longest cached prefix into the paged cache at slot_mapping.

        Returns a bool mask over tokens: True where KV was loaded. Stops at the first
        chunk no tier holds. Releases the pins of lookup_id.
        """
        self._check_slots(tokens, slot_mapping)
        self._enter()
        try:
            return self._retrieve(tokens, slot_mapping, mask, lookup_id, tenant)
        finally:
            self._exit()

    def _retrieve(
        self,
        tokens: Tokens,
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        lookup_id: str | None,
        tenant: str,
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        self.stats.requests["retrieve"].inc()
        self.stats.tokens_requested["retrieve"].inc(len(tokens))
        loaded = torch.zeros(len(tokens), dtype=torch.bool)
        chunks = self.chunks(tokens, mask, tenant)
        try:
            if self._mla is not None:
                self._mla.retrieve(self, chunks, slot_mapping, loaded)
            else:
                # Once close() began, the lower tiers are a miss (get_prefix).
                objs, sources = self.storage.get_prefix([k for _, _, k in chunks])
                self._scatter_all(chunks, objs, sources, slot_mapping, loaded)
        finally:
            if lookup_id is not None:
                self.release_lookup(lookup_id)
            self.stats.latency["retrieve"].observe(time.perf_counter() - t0)
        return loaded

    def _scatter_all(
        self,
        chunks: list[Chunk],
        objs: list[MemoryObj],
        sources: list[str],
        slot_mapping: torch.Tensor,
        loaded: torch.Tensor,
    ) -> None:
        dtype = self.layout.dtype
        fit = 0  # chunks up to the first of an unexpected shape
        for (start, end, _), obj in zip(chunks, objs, strict=False):
            if obj.shape != self._chunk_shape(end - start) or obj.dtype != dtype:
                break
            fit += 1
        done = fit
        try:
            if fit:
                self.copier.scatter_chunks(
                    slot_mapping,
                    [(start, end) for start, end, _ in chunks[:fit]],
                    [obj.tensor for obj in objs[:fit]],
                )
        except BaseException as exc:
            done = getattr(exc, "chunks_done", 0)  # the copier's count of complete ones
            raise
        finally:
            if done:
                # Chunks run back to back from the first: one fill for all of them.
                loaded[chunks[0][0] : chunks[done - 1][1]] = True
            hits: dict[str, list[int]] = {}  # source → [chunks, tokens], counted once
            for (start, end, _), source in zip(chunks[:done], sources, strict=False):
                hit = hits.setdefault(source, [0, 0])
                hit[0] += 1
                hit[1] += end - start
            for source, (count, n) in hits.items():
                self.stats.record_hits(source, count, n)
            for obj in objs:
                obj.ref_down()
        if fit < len(objs):
            start, end, _ = chunks[fit]
            self._fits(objs[fit], end - start)  # logs why
            self.stats.load_errors.inc()

    def _fits(self, obj: MemoryObj, num_tokens: int) -> bool:
        expected = self._chunk_shape(num_tokens)
        if obj.shape != expected or obj.dtype != self.layout.dtype:
            log.error(
                "chunk of unexpected shape dropped",
                shape=tuple(obj.shape),
                expected=tuple(expected),
                dtype=str(obj.dtype),
            )
            return False
        return True

    # -- layer by layer ----------------------------------------------------------------
    def store_layer(
        self,
        tokens: Tokens,
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        tenant: str = "",
    ) -> Generator[int, None, int]:
        """Store layer by layer: call next() after each layer's KV is in the paged
        cache; the call after the last layer commits and returns the tokens stored."""
        self._check_slots(tokens, slot_mapping)  # here: a generator would raise only at next()
        return layerwise.store_layers(self, tokens, slot_mapping, mask, tenant)

    def retrieve_layer(
        self,
        tokens: Tokens,
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        lookup_id: str | None = None,
        *,
        tenant: str = "",
    ) -> Generator[torch.Tensor, None, torch.Tensor]:
        """Load layer by layer: each next() loads one more layer (yielding the mask of
        tokens being loaded); the call after the last layer returns that mask."""
        self._check_slots(tokens, slot_mapping)
        return layerwise.retrieve_layers(self, tokens, slot_mapping, mask, lookup_id, tenant)

    # -- prefetch ---------------------------------------------------------------------
    def prefetch(
        self, tokens: Tokens, lookup_id: str, *, tenant: str = ""
    ) -> concurrent.futures.Future[int]:
        """Look up tokens and pull lower-tier hits into L1, pinned under lookup_id until
        the matching retrieve, `release_lookup`, or the pin timeout. The future gives
        the hit tokens."""
        self._check_open()
        chunks = self.chunks(tokens, tenant=tenant)
        token = object()
        with self._prefetch_lock:
            self._prefetch_tokens[lookup_id] = token
            fut = self.loop.submit(self._prefetch(chunks, lookup_id, token))
            self._prefetches[lookup_id] = fut

        def forget(done: concurrent.futures.Future[int]) -> None:
            # Only its own entry: a later prefetch under the same id keeps its own.
            with self._prefetch_lock:
                if self._prefetches.get(lookup_id) is done:
                    del self._prefetches[lookup_id]
                if self._prefetch_tokens.get(lookup_id) is token:
                    del self._prefetch_tokens[lookup_id]

        fut.add_done_callback(forget)
        return fut

    async def _prefetch(self, chunks: list[Chunk], lookup_id: str, token: object) -> int:
        t0 = time.perf_counter()
        self.stats.requests["prefetch"].inc()
        keys = [key for _, _, key in chunks]
        # Bounded by the pins it makes: past pin_timeout_s they would expire anyway.
        objs, _sources = await self.storage.aget_prefix(keys, self.config.pin_timeout_s)
        pinned = []
        for key, obj in zip(keys, objs, strict=False):
            if self.storage.l1.pin(key):
                pinned.append((self.storage.l1, key))
            obj.ref_down()
        if self._prefetch_tokens.get(lookup_id) is token:
            # The id's older pins (its lookup's, lower tiers' too) go before the lock:
            # hold() would unpin them under it, and a slow tier unpin then stalled
            # every retrieve's release_lookup on the inference thread. No prefetch's
            # pins can be held under the id meanwhile (they are held on this thread),
            # so a race here releases only pins a hold would replace anyway.
            self.pins.release(lookup_id)
        with self._prefetch_lock:
            wanted = self._prefetch_tokens.get(lookup_id) is token
            if wanted:
                self.pins.hold(lookup_id, pinned)
        if not wanted:
            # Released (its request retrieved or dropped) while it pinned: held now,
            # the pins stayed until pin_timeout_s, keeping L1 from evicting them.
            self.storage.unpin(pinned)
        self.stats.latency["prefetch"].observe(time.perf_counter() - t0)
        return chunks[len(objs) - 1][1] if objs else 0

    @property
    def closed(self) -> bool:
        return self._closed

    # -- management -------------------------------------------------------------------
    def compress(
        self,
        tokens: Tokens | None = None,
        method: str = "zstd",
        tier: str = "disk",
        *,
        tenant: str = "",
        params: dict | None = None,
        deadline_s: float | None = None,
    ) -> CompressResult:
        """Rewrite the chunks of tokens (None: all this engine holds there) in tier
        (disk or remote) through method's codec (none, zstd, lz4, cachegen), each
        replaced whole; see services/worker/compress.py."""
        self._check_open()
        keys = None if tokens is None else [k for _, _, k in self.chunks(tokens, tenant=tenant)]
        return rewrite_chunks(self, keys, method, tier, params=params, deadline_s=deadline_s)

    def decompress(
        self,
        tokens: Tokens | None = None,
        tier: str = "disk",
        *,
        tenant: str = "",
        deadline_s: float | None = None,
    ) -> CompressResult:
        """Store the chunks of tokens (None: all) in tier raw again."""
        return self.compress(tokens, "none", tier, tenant=tenant, deadline_s=deadline_s)

    def clear(
        self, tokens: Tokens | None = None, tier: str | None = None, *, tenant: str = ""
    ) -> int:
        """Remove chunks (all, or those of tokens: of tenant's keys) from every tier or
        one; pinned chunks stay. Returns how many chunk copies were removed."""
        self._check_open()
        if tokens is None:
            n = self.storage.clear(tier)
        else:
            n = sum(
                self.storage.remove(key, tier) for _, _, key in self.chunks(tokens, tenant=tenant)
            )
        return n

    def freeze(self, frozen: bool = True) -> None:
        """While frozen, stores are skipped; lookups and retrieves go on."""
        self._frozen = frozen

    @property
    def frozen(self) -> bool:
        return self._frozen

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Call hook first thing in close(), while the event loop still runs (servers
        that live on the loop stop there). Hooks run in reverse order of adding."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Release every resource: pins, the event loop thread, tiers, the pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # First, while tiers (the remote one closes in a hook) and the loop its puts
        # run on are still up: chunks stored just before a shutdown are kept.
        if self.config.close_flush_s > 0 and not self.storage.flush(self.config.close_flush_s):
            log.warning(
                "puts to lower tiers still in flight at close", waited_s=self.config.close_flush_s
            )
        for hook in reversed(self._close_hooks):
            hook()
        for fut in list(self._prefetches.values()):
            fut.cancel()
        self.pins.release_all()
        self.storage.begin_close()
        try:
            try:
                # Cancels the lower-tier gets in flight: their retrieves go on with a miss.
                self.loop.stop()
            except RuntimeError as exc:  # a tier's task ignores the cancel: not the caller's
                log.warning("engine loop did not stop", error=str(exc))
            # Stores and retrieves still running read and write the pool's pages: freed
            # under them, they raised into the inference thread (a retrieve waiting on a
            # lower tier got CancelledError). Left now, they end within one allocation
            # wait plus one lower-tier get. Capped: alloc_timeout_s may be infinite, and
            # Condition.wait raised OverflowError on it, leaving pool and tiers open.
            wait = min(self.config.l1.alloc_timeout_s, _CLOSE_ALLOC_WAIT_S)
            wait = min(wait + self.storage.io_timeout_s, threading.TIMEOUT_MAX)
            if not self._wait_idle(wait):
                log.warning("stores or retrieves still running at close", active=self._active)
        finally:
            try:
                self.storage.close()
            finally:
                self.pool.close()
        log.info("engine closed", instance=self.instance_id, rank=self.rank)
