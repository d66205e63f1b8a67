"""The connector's roles along vLLM's request life cycle, without a vLLM process: a
request that waits for blocks after its lookup and is aborted, one preempted and
resumed, one behind vLLM's own prefix-cache hit whose load fails (the end-to-end runs
are tests/integration/test_vllm_lifecycle.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_vllm_connector_parts import (
    CHUNK,
    FakeClient,
    new_step,
    paged,
    request,
    run_step,
    sched,
    tokens,
    workers,  # noqa: F401 (a fixture)
)

from kvmesh.services.worker.vllm.metadata import KvmeshConnectorMetadata, LoadOp, SaveOp


def cached_step(req_id: str, blocks: list[int], computed: int, scheduled: int, resumed: bool):
    cached = SimpleNamespace(
        req_ids=[req_id],
        resumed_req_ids={req_id} if resumed else set(),
        new_block_ids=[(blocks,)],
        num_computed_tokens=[computed],
    )
    out = new_step(None, [], 0, 0, cached)
    out.num_scheduled_tokens = {req_id: scheduled}
    return out


def test_aborted_while_waiting_for_blocks_releases_and_loads_nothing() -> None:
    client = FakeClient(hits=64)
    s = sched(client)
    req = request("w", 100)
    # Two scheduling passes look it up (each pins under its id, the second replacing
    # the first); vLLM has no blocks for it either time, so no allocation follows.
    assert s.get_num_new_matched_tokens(req, 0) == (64, False)
    assert s.build_connector_meta(new_step(None, [], 0, 0)).loads == []
    assert s.get_num_new_matched_tokens(req, 0) == (64, False)
    assert s.build_connector_meta(new_step(None, [], 0, 0)).loads == []
    assert client.released == []
    s.request_finished(req)  # aborted
    assert client.released == ["w"]
    assert s._reqs == {}


def test_preempted_request_is_loaded_once_into_its_new_blocks() -> None:
    client = FakeClient(hits=0)
    s = sched(client)
    req = request("r", 100)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, 0)
    meta = s.build_connector_meta(new_step(req, list(range(7)), 0, 100))
    assert meta.loads == [] and [len(op.tokens) for op in meta.saves] == [96]
    # Preempted after some decoding: vLLM frees its blocks and looks it up again with
    # its outputs appended; kvmesh has the 96 tokens it saved.
    req.all_token_ids = [*req.all_token_ids, 7, 8, 9]
    req.num_tokens = 103
    client.hits = 96
    assert s.get_num_new_matched_tokens(req, 0) == (96, False)
    s.update_state_after_alloc(req, 96)
    meta = s.build_connector_meta(cached_step("r", [20, 21, 22, 23, 24, 25, 26], 96, 7, True))
    (load,) = meta.loads
    assert load.block_ids == [20, 21, 22, 23, 24, 25, 26]
    assert (load.skip, len(load.tokens), load.local) == (0, 96, 0)
    assert meta.saves == []  # its chunks are stored already
    # the next step (decoding) neither loads nor saves again
    meta = s.build_connector_meta(cached_step("r", [], 103, 1, False))
    assert meta.loads == [] and meta.saves == []
    assert s.request_finished(req)[1] == {"kvmesh_result": {"hit_tokens": 96, "saved_tokens": 96}}


def test_load_behind_a_vllm_hit_says_where_vllm_stops() -> None:
    s = sched(FakeClient(hits=96))
    req = request("r", 100)
    assert s.get_num_new_matched_tokens(req, 48) == (48, False)
    s.update_state_after_alloc(req, 48)
    (load,) = s.build_connector_meta(new_step(req, list(range(7)), 96, 4)).loads
    assert (load.skip, load.local, len(load.tokens)) == (CHUNK, 48, 96)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_failed_load_across_a_vllm_hit_spares_vllms_blocks(workers, layerwise: bool) -> None:  # noqa: F811
    """vLLM had tokens [0, 48) (blocks 1-3 of 16, maybe shared with running requests);
    kvmesh loads chunk [32, 64) whole and it is gone: only block 4 ([48, 64)) is
    kvmesh's to report. Reporting block 3 made vLLM roll back every running request
    holding it."""
    caches = paged()
    names = sorted(caches)
    w = workers(layerwise=layerwise)
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("s", tokens(32), [0, 5])]), names)
    load = LoadOp("r", tokens(64), [1, 2, 3, 4], skip=CHUNK, local=48)
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), names) == {4}
    # a load that cannot start at all (too few blocks) spares them too
    load = LoadOp("r2", tokens(64), [1, 2, 3], skip=CHUNK, local=48)
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), names) == set()
    # without a vLLM hit, the failure starts at the first missing token
    load = LoadOp("r3", tokens(64), [6, 7, 8, 9])
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), names) == {8, 9}


def test_a_load_that_cannot_be_planned_fails_its_blocks(workers, monkeypatch) -> None:  # noqa: F811
    from kvmesh.services.worker.vllm import scheduler as planner

    client = FakeClient(hits=64)
    s = sched(client)
    req, other = request("r", 100), request("o", 100, seed=1)
    for r in (req, other):
        s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(req, 64)
    s.update_state_after_alloc(other, 0)
    real, calls = planner.token_tensor, []

    def first_call_fails(ids):
        calls.append(len(ids))
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(ids)

    monkeypatch.setattr(planner, "token_tensor", first_call_fails)
    step = new_step(req, [3, 4, 5, 6, 7, 8, 9], 64, 36)
    step.scheduled_new_reqs.append(
        SimpleNamespace(
            req_id="o", block_ids=([10, 11, 12, 13, 14, 15, 16],), num_computed_tokens=0
        )
    )
    step.num_scheduled_tokens["o"] = 100
    meta = s.build_connector_meta(step)
    # r's load could not be planned: vLLM counts 64 tokens as computed in blocks 3-6,
    # which hold whatever was there. They are reported failed; o is planned as usual.
    assert meta.loads == [] and [op.req_id for op in meta.saves] == ["o"]
    assert [(f.req_id, f.first, f.end) for f in meta.failed] == [("r", 0, 64)]
    w = workers()
    w.register_kv_caches(paged())
    assert run_step(w, meta, []) == {3, 4, 5, 6}
    # r goes on without kvmesh (its state is not trusted); its pins are released at
    # the end as usual
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    monkeypatch.setattr(planner, "token_tensor", real)
    cached = cached_step("r", [17], 100, 1, False)
    assert s.build_connector_meta(cached).saves == []
    client.released.clear()
    s.request_finished(req)
    assert client.released == ["r"]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_request_whose_load_failed_saves_nothing_that_step(workers, layerwise: bool) -> None:  # noqa: F811
    """The planner puts a request's load and the save of the chunks its step computes
    in one step. When the load fails, that KV was computed over blocks the load did
    not fill: storing it served wrong KV to later requests. Another request's save in
    the same step goes ahead."""
    caches = paged()
    names = sorted(caches)
    w = workers(layerwise=layerwise)
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("s", tokens(32), [0, 5])]), names)
    blocks = [1, 2, 3, 4, 6, 7]
    meta = KvmeshConnectorMetadata(
        loads=[LoadOp("r", tokens(64), blocks)],  # chunk 1 is not stored: fails
        saves=[
            SaveOp("r", tokens(96), blocks, 64),  # chunk 2, computed over blocks 3-4
            SaveOp("o", tokens(32) + 7000, [12, 13]),
        ],
    )
    assert run_step(w, meta, names) == {3, 4}
    eng = w.engine
    keys = [k for _, _, k in eng.chunks(tokens(96))]
    assert eng.storage.l1.batched_contains(keys[2:]) == 0
    assert eng.lookup(tokens(32) + 7000) == 32  # o's save was made
    # chunk 1 stored later by anyone: the prefix stops where the bad chunk would be
    run_step(
        w, KvmeshConnectorMetadata(saves=[SaveOp("x", tokens(64), [9, 10, 11, 14], 32)]), names
    )
    assert eng.lookup(tokens(96)) == 64


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_whole_prompt_hit_whose_last_chunk_is_gone_does_not_store_it_back(
    workers,  # noqa: F811
    layerwise: bool,
) -> None:
    """A whole-prompt hit loads and saves its last chunk in the same step; with that
    chunk gone by load time, the save stored what blocks 6-7 held before the step."""
    caches = paged()
    names = sorted(caches)
    w = workers(layerwise=layerwise)
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("s", tokens(64), [0, 5, 9, 10])]), names)
    blocks = [1, 2, 3, 4, 6, 7]
    meta = KvmeshConnectorMetadata(
        loads=[LoadOp("r", tokens(96), blocks)],
        saves=[SaveOp("r", tokens(96), blocks, 64)],
    )
    assert run_step(w, meta, names) == {6, 7}
    assert w.engine.lookup(tokens(96)) == 64


class _Unreadable:
    """A block table whose reading fails (what the outer fallback guards against)."""

    def __getitem__(self, _i: int) -> list[int]:
        raise RuntimeError("injected: unreadable block table")

    def __bool__(self) -> bool:
        return True


def test_a_step_that_cannot_be_read_keeps_its_plan_and_fails_the_loads_left(
    workers,  # noqa: F811
) -> None:
    """When a request's block table cannot be read, the step's plan so far stands
    (a's load, its tables were read) and the loads still due are reported failed in
    the blocks vLLM allocated for them (update_state_after_alloc); returning an empty
    plan left both loads' tokens counted as computed in blocks holding anything."""
    client = FakeClient(hits=64)
    s = sched(client)
    a, b = request("a", 100), request("b", 100, seed=1)
    for r in (a, b):
        s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(a, 64, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)))
    s.update_state_after_alloc(b, 64, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)))
    step = new_step(a, [1, 2, 3, 4, 9, 10, 11], 64, 36)
    step.scheduled_new_reqs.append(
        SimpleNamespace(req_id="b", block_ids=_Unreadable(), num_computed_tokens=64)
    )
    step.num_scheduled_tokens["b"] = 36
    meta = s.build_connector_meta(step)
    assert [op.req_id for op in meta.loads] == ["a"]
    assert [(f.req_id, f.block_ids, f.first, f.end) for f in meta.failed] == [
        ("b", [5, 6, 7, 8], 0, 64)
    ]
    w = workers()
    w.register_kv_caches(paged())
    assert {5, 6, 7, 8} <= run_step(w, meta, [])
    # neither goes on with kvmesh: no further saves from tables not trusted
    assert s.build_connector_meta(cached_step("a", [12], 100, 1, False)).saves == []


def test_a_hybrid_model_is_refused_at_start() -> None:
    """kvmesh scatters every layer by the first KV cache group's block table: with a
    second group (sliding-window or Mamba layers) it would write KV into the wrong
    blocks, so the connector refuses such a model with a clear message."""
    from kvmesh.services.worker.vllm.connector import check_one_kv_cache_group

    check_one_kv_cache_group(None)  # no config given: nothing to check
    check_one_kv_cache_group(SimpleNamespace(kv_cache_groups=["full"]))
    with pytest.raises(ValueError, match="one KV cache group; this one has 2"):
        check_one_kv_cache_group(SimpleNamespace(kv_cache_groups=["full", "sliding"]))


def test_mla_under_pipeline_and_any_model_under_context_parallelism_are_refused() -> None:
    """MLA KV is kept once, by rank 0 of the tensor-parallel group: a pipeline stage
    past the first (other layers, no rank 0) would never load or save. Under context
    parallelism a rank holds a share of each block's tokens, which kvmesh would key and
    place as whole blocks. vLLM's own config classes, so a renamed field fails here."""
    from vllm.config import ParallelConfig

    from kvmesh.services.worker.vllm.connector import check_parallelism

    mla, dense = SimpleNamespace(use_mla=True), SimpleNamespace(use_mla=False)
    check_parallelism(mla, ParallelConfig(tensor_parallel_size=2))
    check_parallelism(dense, ParallelConfig(pipeline_parallel_size=4))
    with pytest.raises(ValueError, match="MLA models with pipeline parallelism"):
        check_parallelism(mla, ParallelConfig(pipeline_parallel_size=2))
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        pc = ParallelConfig()
        setattr(pc, field, 2)  # set after construction: vLLM checks the world it needs
        with pytest.raises(ValueError, match=f"context parallelism \\({field}=2\\)"):
            check_parallelism(dense, pc)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_save_over_blocks_whose_load_failed_is_not_stored(workers, layerwise: bool) -> None:  # noqa: F811
    """vLLM caches a loading request's blocks at once, so a request B scheduled in the
    same step can share them through its prefix cache. When A's load fails there, B's
    next chunk was computed over those blocks too: vLLM rolls B back, and kvmesh must
    not store that chunk (found by review; it was stored and later served)."""
    caches = paged()
    names = sorted(caches)
    w = workers(layerwise=layerwise)
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("s", tokens(32), [0, 5])]), names)
    b_tokens = torch.cat([tokens(64), tokens(32) + 5000])
    meta = KvmeshConnectorMetadata(
        loads=[LoadOp("a", tokens(64), [1, 2, 3, 4, 6, 7])],  # fails from token 32
        saves=[SaveOp("b", b_tokens, [1, 2, 3, 4, 8, 9], 64)],  # shares blocks 1-4
    )
    assert run_step(w, meta, names) == {3, 4}
    eng = w.engine
    keys = [k for _, _, k in eng.chunks(b_tokens)]
    assert eng.storage.l1.batched_contains(keys[2:]) == 0
    run_step(
        w, KvmeshConnectorMetadata(saves=[SaveOp("x", tokens(64), [10, 11, 12, 14], 32)]), names
    )
    assert eng.lookup(b_tokens) == 64
