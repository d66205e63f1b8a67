"""The scheduler role: count cached prefixes, and plan each step's loads and saves.

vLLM asks `get_num_new_matched_tokens` before it allocates blocks for a waiting
request; the answer comes from the worker engines over the lookup protocol (every
rank, minimum, with a deadline, pinning what was counted under the request id). After
allocation, `update_state_after_alloc` records the load; `build_connector_meta` turns
the step's scheduled requests into LoadOps (before the forward pass) and SaveOps (the
prompt's chunks that this step completes). Nothing here may raise into vLLM's
scheduler: any failure is logged and counted as a miss, and a load vLLM already
counted that cannot be planned has its blocks reported failed (recomputed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.common.config import EngineConfig
from kvmesh.services.worker.lookup_client import LookupClient
from kvmesh.services.worker.pd_receiver import hold_id
from kvmesh.services.worker.vllm.metadata import (
    FailedLoad,
    KvmeshConnectorMetadata,
    LoadOp,
    SaveOp,
    token_tensor,
)
from kvmesh.services.worker.vllm.options import (
    RequestOptions,
    parse_request_options,
    with_cache_salt,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# vLLM's own logging: the scheduler process is configured by vLLM, not by kvmesh.
log = logging.getLogger("kvmesh.connector.scheduler")

RESULT_KEY = "kvmesh_result"


@dataclass
class _Req:
    request: Request
    options: RequestOptions
    cacheable: bool
    hit: int = 0  # tokens the last lookup found
    local: int = 0  # tokens vLLM had computed itself at that lookup
    load_end: int = 0  # > 0 while a load waits for build_connector_meta
    external: int = 0  # tokens vLLM counted as loaded from kvmesh
    saved_upto: int = 0  # prompt tokens whose chunks are saved or planned
    pushed_upto: int = 0  # PD prefill: prompt tokens whose chunks are pushed or planned
    block_ids: list[int] = field(default_factory=list)
    # The blocks vLLM allocated with a load counted (update_state_after_alloc): what is
    # reported failed if the step's own block tables cannot be read.
    alloc_blocks: list[int] = field(default_factory=list)


class SchedulerSide:
    def __init__(
        self,
        engine_config: EngineConfig,
        client: LookupClient,
        *,
        can_load: bool = True,
        can_save: bool = True,
    ) -> None:
        self.config = engine_config
        self.chunk = engine_config.chunk_size
        self.client = client
        self.can_load = can_load
        self.can_save = can_save
        self._reqs: dict[str, _Req] = {}

    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            options, problem = parse_request_options(request.kv_transfer_params)
            options = with_cache_salt(options, getattr(request, "cache_salt", None))
            if problem is not None:
                log.warning("request %s served without kvmesh: %s", request.request_id, problem)
            # Token ids name the KV only for plain text prompts without adapters.
            cacheable = (
                request.prompt_token_ids is not None
                and getattr(request, "prompt_embeds", None) is None
                and not getattr(request, "mm_features", None)
                and getattr(request, "lora_request", None) is None
            )
            st = _Req(request, options, cacheable)
            self._reqs[request.request_id] = st
        return st

    # -- lookups ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        st = self._state(request)
        # vLLM reads no cache for a request that asks for prompt logprobs (they need
        # every prompt token computed) and zeroes any hit: no lookup, no pin to undo.
        skip = st.options.skip_load or getattr(request, "skip_reading_prefix_cache", False)
        if not (self.can_load and st.cacheable and not skip):
            return 0, False
        try:
            n = request.num_tokens
            hit = self.client.lookup(
                request.all_token_ids[:n], request.request_id, tenant=st.options.tenant
            )
        except Exception:
            log.exception("kvmesh lookup failed for %s; counting a miss", request.request_id)
            hit = 0
        st.hit, st.local = hit, num_computed_tokens
        pd = st.options.pd
        if pd is not None and not pd.endpoints:
            # A decode after a PD prefill: a short hit means the decoder computes the rest.
            log.info(
                "PD decode %s (transfer %s): %d of %d prompt tokens in kvmesh",
                request.request_id,
                pd.transfer_id,
                hit,
                request.num_tokens,
            )
        # vLLM must compute at least the last token itself.
        external = max(0, min(hit, request.num_tokens - 1) - num_computed_tokens)
        if external == 0 and hit:
            self.client.release(request.request_id)
        return external, False

    def update_state_after_alloc(
        self, request: Request, num_external_tokens: int, blocks: Any = None
    ) -> None:
        st = self._state(request)
        if num_external_tokens <= 0:
            st.load_end = 0
            if st.hit:
                self.client.release(request.request_id)
            return
        counted_end = st.local + num_external_tokens
        # Whole chunks: the last may reach a token past what vLLM counts as loaded
        # (it recomputes that token into the same slot).
        st.load_end = min(st.hit, -(-counted_end // self.chunk) * self.chunk)
        st.external = num_external_tokens
        st.saved_upto = max(st.saved_upto, counted_end // self.chunk * self.chunk)
        st.alloc_blocks = _first_group(blocks)

    # -- per step -----------------------------------------------------------------------
    def build_connector_meta(self, out: SchedulerOutput) -> KvmeshConnectorMetadata:
        meta = KvmeshConnectorMetadata()
        try:
            for new in out.scheduled_new_reqs:
                st = self._reqs.get(new.req_id)
                if st is None:
                    continue
                st.block_ids = list(new.block_ids[0]) if new.block_ids else []
                self._plan_or_give_up(st, meta, new.num_computed_tokens, out.num_scheduled_tokens)
            cached = out.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                st = self._reqs.get(req_id)
                if st is None:
                    continue
                new_blocks = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_blocks[0]) if new_blocks else []
                elif new_blocks:
                    st.block_ids.extend(new_blocks[0])
                computed = cached.num_computed_tokens[i]
                self._plan_or_give_up(st, meta, computed, out.num_scheduled_tokens)
        except Exception:
            # The step's block tables are unknown: no request's blocks can be trusted
            # for a save from now on. What was planned before stands (its tables were
            # read); a load still due is reported failed in the blocks vLLM allocated
            # for it, since vLLM counts its tokens as computed.
            log.exception("kvmesh could not read this step; its requests go without kvmesh")
            for st in self._reqs.values():
                self._give_up(st, meta, st.alloc_blocks, st.load_end)
        return meta

    def _plan_or_give_up(
        self, st: _Req, meta: KvmeshConnectorMetadata, computed: int, scheduled: dict[str, int]
    ) -> None:
        loads, saves, load_end = len(meta.loads), len(meta.saves), st.load_end
        try:
            self._plan(st, meta, computed, scheduled)
        except Exception:
            log.exception(
                "kvmesh could not plan %s; it goes on without kvmesh", st.request.request_id
            )
            del meta.loads[loads:], meta.saves[saves:]
            self._give_up(st, meta, st.block_ids, load_end)

    @staticmethod
    def _give_up(st: _Req, meta: KvmeshConnectorMetadata, blocks: list[int], load_end: int) -> None:
        """st goes on without kvmesh. A load still due (load_end > 0) is reported failed
        in blocks: vLLM counts its tokens as computed, so they must be recomputed, never
        read as they are; and it is no hit."""
        if load_end:
            req_id = st.request.request_id
            if blocks:
                meta.failed.append(FailedLoad(req_id, list(blocks), st.local, load_end))
            else:
                log.error("kvmesh cannot report the load of %s as failed", req_id)
            st.external = 0
        st.load_end, st.cacheable = 0, False

    def _plan(
        self, st: _Req, meta: KvmeshConnectorMetadata, computed: int, scheduled: dict[str, int]
    ) -> None:
        req_id = st.request.request_id
        tokens = st.request.all_token_ids
        if st.load_end:
            skip = st.local // self.chunk * self.chunk
            meta.loads.append(
                LoadOp(
                    req_id,
                    token_tensor(tokens[: st.load_end]),
                    list(st.block_ids),
                    skip,
                    st.options.tenant,
                    st.local,
                )
            )
            st.load_end = 0
        prompt_len = st.request.num_prompt_tokens
        end = min(computed + scheduled.get(req_id, 0), prompt_len)
        target = end // self.chunk * self.chunk
        if self.config.keys_partial_chunk and end == prompt_len:
            target = end
        pd = st.options.pd
        if pd is not None and pd.endpoints and st.cacheable:
            # A prefill for a decoder: push every prompt chunk, those vLLM or kvmesh
            # already had included (the decoder has none of them); the push stores
            # them here too.
            if target > st.pushed_upto:
                meta.saves.append(
                    SaveOp(
                        req_id,
                        token_tensor(tokens[:target]),
                        list(st.block_ids),
                        st.pushed_upto,
                        st.options.tenant,
                        pd.transfer_id,
                        list(pd.endpoints),
                    )
                )
                st.pushed_upto = target
            return
        if not (self.can_save and st.cacheable and not st.options.skip_save):
            return
        if target > st.saved_upto:
            meta.saves.append(
                SaveOp(
                    req_id,
                    token_tensor(tokens[:target]),
                    list(st.block_ids),
                    st.saved_upto,
                    st.options.tenant,
                )
            )
            st.saved_upto = target

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.hit:
            # Pins not consumed by a load (aborted, preempted, never scheduled).
            self.client.release(request.request_id)
        pd = st.options.pd
        if pd is not None and not pd.endpoints:
            # The decoder's vLLM is done with what the prefiller pushed: unpin it.
            self.client.release(hold_id(pd.transfer_id))
        return False, {RESULT_KEY: {"hit_tokens": st.external, "saved_tokens": st.saved_upto}}

    def close(self) -> None:
        self.client.close()


def _first_group(blocks: Any) -> list[int]:
    """The block ids of vLLM's KVCacheBlocks (its first and only KV cache group), or
    none when there is nothing readable."""
    if blocks is None:
        return []
    try:
        return list(blocks.get_block_ids()[0])
    except Exception:
        return []
