"""The worker role: load and save through this rank's KVEngine, as the step's
metadata says.

`register_kv_caches` builds the rank's engine over vLLM's paged KV tensors and starts
its lookup server. Each step, `start_load_kv` runs the LoadOps before the forward
pass: whole at once, or (layerwise) layer 0 at once and layer i when the model asks
for it in `wait_for_layer_load`. Saves run after each layer (`save_kv_layer`,
layerwise) or after the forward pass (`wait_for_save`), chunk by chunk, full chunks
only. A load that comes up short (a chunk gone since the lookup, a tier error) marks
the blocks from the first missing token on as failed, so vLLM recomputes them; a
failed save is a future miss. Nothing here raises into vLLM's forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Generator, Mapping
from dataclasses import dataclass

import structlog
import torch

from kvmesh.common.config import EngineConfig
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.services.worker.builder import destroy_engine, get_engine, get_or_create_engine
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.lookup_server import attach_lookup_server
from kvmesh.services.worker.pd_sender import PdTarget, push_layers
from kvmesh.services.worker.vllm.kv_events import EventTranslator, KvmeshKVEvents
from kvmesh.services.worker.vllm.metadata import (
    KvmeshConnectorMetadata,
    LoadOp,
    SaveOp,
    slot_mapping,
)

log = logging.getLogger("kvmesh.connector.worker")


@dataclass
class _LayerwiseLoad:
    op: LoadOp
    gen: Generator[torch.Tensor, None, torch.Tensor]
    layers_done: int = 0
    finished: bool = False


@dataclass
class _LayerwiseSave:
    gen: Generator[int, None, int]
    layers_done: int = 0
    finished: bool = False
    req_id: str = ""
    blocks: frozenset[int] = frozenset()  # the blocks its chunks were computed over


def layer_order(names: list[str]) -> dict[str, int]:
    """Layer name → index in the engine's chunk layout (gpu_ext orders a vLLM dict by
    the one number in each name, e.g. model.layers.12.self_attn.attn; without such
    numbers, in the dict's order)."""
    numbers = []
    for name in names:
        found = re.findall(r"\d+", name)
        numbers.append(int(found[0]) if len(found) == 1 else None)
    if None in numbers or len(set(numbers)) != len(numbers):
        return {name: i for i, name in enumerate(names)}
    ranked = sorted(range(len(names)), key=lambda i: numbers[i])  # type: ignore[arg-type, return-value]
    return {names[i]: pos for pos, i in enumerate(ranked)}


class WorkerSide:
    def __init__(
        self,
        engine_config: EngineConfig,
        instance_id: str,
        rank: int,
        world_size: int,
        block_size: int,
        *,
        events_enabled: bool = False,
        curve: CurveKeys | None = None,
    ) -> None:
        self.config = engine_config
        self.curve = curve
        self.instance_id = instance_id
        self.rank = rank
        self.world_size = world_size
        self.block_size = block_size
        self.layerwise = engine_config.layerwise
        self.engine: KVEngine | None = None
        self._owns_engine = False
        self._layers: dict[str, int] = {}
        self._meta: KvmeshConnectorMetadata | None = None
        self._loads: list[_LayerwiseLoad] = []
        self._saves: list[_LayerwiseSave] | None = None
        self._failed_blocks: set[int] = set()
        # Requests whose load failed this step, and the blocks it reported: KV computed
        # in this step over those blocks (the request's own, or another request's that
        # shares them through vLLM's prefix cache) is never saved: it would be served.
        self._failed_reqs: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._events = EventTranslator(engine_config.chunk_size) if events_enabled else None

    # -- set-up -------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], mla_group: object | None = None
    ) -> None:
        existed = get_engine(self.instance_id, self.rank) is not None
        self.engine = get_or_create_engine(
            self.instance_id,
            self.rank,
            self.config,
            dict(kv_caches),
            world_size=self.world_size,
            mla_group=mla_group,
            curve=self.curve,
        )
        if existed:
            self.engine.register_kv_caches(dict(kv_caches))
        else:
            self._owns_engine = True
            attach_lookup_server(self.engine)
        self._layers = layer_order(list(kv_caches))

    # -- per step -----------------------------------------------------------------------
    def begin_step(self, meta: KvmeshConnectorMetadata) -> None:
        self._meta = meta
        self._loads = []
        self._saves = None
        self._failed_reqs, self._bad_blocks = set(), set()
        for failed in meta.failed:
            self._report_failed(failed.req_id, failed.block_ids, failed.first, failed.end)

    def end_step(self) -> None:
        self._finish_loads()
        self._meta = None

    def start_load_kv(self) -> None:
        meta, engine = self._meta, self.engine
        if meta is None or engine is None or not meta.loads:
            return
        for op in meta.loads:
            try:
                with _request(op.req_id):
                    loaded = self._start_load(engine, op)
            except Exception:
                log.exception("kvmesh load of %s failed; vLLM recomputes it", op.req_id)
                loaded = None
            self._check_loaded(op, loaded)

    def _start_load(self, engine: KVEngine, op: LoadOp) -> torch.Tensor | None:
        """The mask of what op loads (layerwise: what its layers will load)."""
        slots = slot_mapping(op.block_ids, self.block_size, len(op.tokens))
        mask = self._mask(op.skip, len(op.tokens))
        if not self.layerwise:
            return engine.retrieve(op.tokens, slots, mask, lookup_id=op.req_id, tenant=op.tenant)
        gen = engine.retrieve_layer(op.tokens, slots, mask, lookup_id=op.req_id, tenant=op.tenant)
        load = _LayerwiseLoad(op, gen)
        self._loads.append(load)
        return self._step_load(load)  # layer 0, and the mask of what comes

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        index = self._layers.get(layer_name)
        for load in self._loads:
            try:
                while not load.finished and (index is None or load.layers_done <= index):
                    self._step_load(load)
            except Exception:
                log.exception("kvmesh layer load of %s failed", load.op.req_id)
                load.finished = True
                self._fail_from(load.op, load.op.skip)

    def save_kv_layer(self, layer_name: str) -> None:
        meta, engine = self._meta, self.engine
        if not self.layerwise or meta is None or engine is None or not meta.saves:
            return
        if self._saves is None:
            self._saves = []
            for op in meta.saves:
                if self._skip_save(op):
                    continue
                try:
                    gen = self._save_gen(engine, op, layerwise=True)
                except Exception:
                    log.exception("kvmesh save of %s not started", op.req_id)
                    continue
                self._saves.append(_LayerwiseSave(gen, req_id=op.req_id, blocks=self._over(op)))
                self._note_saved(op)
        index = self._layers.get(layer_name)
        for save in self._saves:
            self._step_save(save, index)

    def wait_for_save(self) -> None:
        self._finish_loads()
        meta, engine = self._meta, self.engine
        if meta is None or engine is None or not meta.saves:
            return
        if self.layerwise:
            for save in self._saves or []:
                self._step_save(save, None)  # whatever layers were not saved yet
            self._saves = []
            return
        for op in meta.saves:
            if self._skip_save(op):
                continue
            try:
                with _request(op.req_id):
                    self._save(engine, op)
                self._note_saved(op)
            except Exception:
                log.exception("kvmesh save of %s failed", op.req_id)

    def _save(self, engine: KVEngine, op: SaveOp) -> None:
        if op.pd_transfer:
            for _ in self._save_gen(engine, op, layerwise=False):
                pass
        else:
            slots = slot_mapping(op.block_ids, self.block_size, len(op.tokens))
            engine.store(op.tokens, slots, self._mask(op.skip, len(op.tokens)), tenant=op.tenant)

    def take_failed_blocks(self) -> set[int]:
        self._finish_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_events(self) -> KvmeshKVEvents | None:
        if self._events is None or self.engine is None:
            return None
        events = self._events.translate(self.engine.events.drain(), self.engine.namespace.ns_id)
        if not events:
            return None
        out = KvmeshKVEvents(num_workers=1)
        out.add_events(events)
        return out

    def shutdown(self) -> None:
        self._finish_loads()
        if self._owns_engine:
            destroy_engine(self.instance_id, self.rank)
        self.engine = None

    # -- helpers ------------------------------------------------------------------------
    def _save_gen(
        self, engine: KVEngine, op: SaveOp, *, layerwise: bool
    ) -> Generator[int, None, int]:
        """The generator that stores op (or, for a PD prefill, pushes it to the decoder
        and stores it), stepped once per layer."""
        slots = slot_mapping(op.block_ids, self.block_size, len(op.tokens))
        mask = self._mask(op.skip, len(op.tokens))
        if not op.pd_transfer:
            return engine.store_layer(op.tokens, slots, mask, tenant=op.tenant)
        # Rank r of the prefiller writes to rank r of the decoder.
        endpoint = op.pd_endpoints[self.rank % len(op.pd_endpoints)]
        target = PdTarget(op.pd_transfer, endpoint)
        return push_layers(engine, op.tokens, slots, mask, target, op.tenant, layerwise=layerwise)

    @staticmethod
    def _mask(skip: int, n: int) -> torch.Tensor | None:
        if not skip:
            return None
        mask = torch.ones(n, dtype=torch.bool)
        mask[:skip] = False
        return mask

    def _step_load(self, load: _LayerwiseLoad) -> torch.Tensor | None:
        try:
            with _request(load.op.req_id):
                loaded = next(load.gen)
        except StopIteration as stop:
            load.finished = True
            loaded = stop.value
        load.layers_done += 1
        return loaded

    def _step_save(self, save: _LayerwiseSave, index: int | None) -> None:
        if not save.finished and (
            save.req_id in self._failed_reqs or not self._bad_blocks.isdisjoint(save.blocks)
        ):
            # Its load failed at a layer after this save began: the chunks it holds
            # are dropped, not committed.
            log.warning("kvmesh save of %s dropped: a load it rests on failed", save.req_id)
            save.finished = True
            save.gen.close()
            return
        try:
            while not save.finished and (index is None or save.layers_done <= index):
                try:
                    with _request(save.req_id):
                        next(save.gen)
                except StopIteration:
                    save.finished = True
                save.layers_done += 1
        except Exception:
            log.exception("kvmesh layer save failed")
            save.finished = True
            save.gen.close()

    def _finish_loads(self) -> None:
        for load in self._loads:
            if not load.finished:
                # The model did not ask for every layer (or failed): what was not
                # loaded cannot be trusted.
                load.gen.close()
                self._fail_from(load.op, load.op.skip)
        self._loads = []

    def _check_loaded(self, op: LoadOp, loaded: torch.Tensor | None) -> None:
        n = len(op.tokens)
        if loaded is None:
            self._fail_from(op, op.skip)
            return
        missing = (~loaded[op.skip : n]).nonzero()
        if missing.numel():
            first = op.skip + int(missing[0])
            log.warning(
                "kvmesh loaded %d of %d tokens of %s; vLLM recomputes the rest",
                first - op.skip,
                n - op.skip,
                op.req_id,
            )
            self._fail_from(op, first)

    def _fail_from(self, op: LoadOp, first_token: int) -> None:
        # Blocks below op.local are vLLM's own prefix-cache hit, valid whatever this
        # load did (it writes them only with the same tokens' KV) and maybe shared:
        # reporting one would make vLLM roll back every running request holding it.
        self._report_failed(op.req_id, op.block_ids, max(first_token, op.local), len(op.tokens))

    def _report_failed(self, req_id: str, block_ids: list[int], first: int, end: int) -> None:
        """Tokens [first, end) of req_id did not load: their blocks go to vLLM as failed,
        and nothing computed over them this step is saved."""
        bad = block_ids[first // self.block_size : -(-end // self.block_size)]
        self._failed_blocks.update(bad)
        self._bad_blocks.update(bad)
        self._failed_reqs.add(req_id)

    def _over(self, op: SaveOp) -> frozenset[int]:
        """The blocks whose KV op's chunks were computed over: all before its end."""
        return frozenset(op.block_ids[: -(-len(op.tokens) // self.block_size)])

    def _skip_save(self, op: SaveOp) -> bool:
        if op.req_id not in self._failed_reqs and self._bad_blocks.isdisjoint(self._over(op)):
            return False
        log.warning("kvmesh save of %s skipped: a load it rests on failed this step", op.req_id)
        return True

    def _note_saved(self, op: object) -> None:
        if self._events is not None:
            self._events.remember(self.engine, op)  # type: ignore[arg-type]


def _request(req_id: str) -> contextlib.AbstractContextManager[None]:
    """vLLM's request id on every kvmesh line logged while working on it (it is also
    the lookup id the scheduler pinned under, so one id follows the request from the
    scheduler's lookup through the worker's load)."""
    return structlog.contextvars.bound_contextvars(request_id=req_id)
