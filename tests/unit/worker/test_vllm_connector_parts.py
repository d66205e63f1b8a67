"""The connector's two roles without a vLLM process: the scheduler's planning (with a
fake lookup client and vLLM-shaped requests) and the worker's loads and saves (with a
real engine over a vLLM-CPU-shaped paged cache); plus options and KV events."""

from __future__ import annotations

import collections
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvtest.paged import bits, random_fill
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvmesh.services.worker.builder import destroy_all_engines
from kvmesh.services.worker.vllm.kv_events import KvmeshKVEvents
from kvmesh.services.worker.vllm.metadata import (
    KvmeshConnectorMetadata,
    LoadOp,
    SaveOp,
    slot_mapping,
)
from kvmesh.services.worker.vllm.options import (
    NO_CACHE,
    SALTED,
    parse_extra_config,
    parse_request_options,
)
from kvmesh.services.worker.vllm.scheduler import SchedulerSide
from kvmesh.services.worker.vllm.worker import WorkerSide, layer_order

CHUNK, BLOCK = 32, 16
LAYERS = 2


# -- options --------------------------------------------------------------------------------


def test_extra_config_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_CONFIG", raising=False)
    opts, cfg = parse_extra_config({})
    assert cfg.engine.chunk_size == 256 and opts.lookup_timeout_s == 0.5
    _, cfg = parse_extra_config({"config": {"engine": {"chunk_size": 64}}})
    assert cfg.engine.chunk_size == 64
    path = tmp_path / "kvmesh.yaml"
    path.write_text("engine:\n  chunk_size: 128\n  layerwise: true\n")
    _, cfg = parse_extra_config(
        {"config_path": str(path), "config": {"engine": {"chunk_size": 512}}}
    )
    assert (cfg.engine.chunk_size, cfg.engine.layerwise) == (512, True)
    opts, _ = parse_extra_config({"instance_id": "x", "lookup_timeout_s": 0.1})
    assert (opts.instance_id, opts.lookup_timeout_s) == ("x", 0.1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"confg": {}}, "unknown key 'confg'; did you mean 'config'"),
        ({"config": {"engine": {"chunk_sise": 1}}}, "engine.chunk_sise: unknown key"),
        ({"config": {"engine": {"chunk_size": -1}}}, "engine.chunk_size"),
        ({"config_path": "/nonexistent/kvmesh.yaml"}, "is not a file"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
        ({"config": [1]}, "config"),
    ],
)
def test_bad_extra_config_fails_clearly(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_extra_config(extra)


def test_request_options() -> None:
    assert parse_request_options(None)[0].tenant == ""
    assert parse_request_options({"other": 1})[1] is None
    opts, problem = parse_request_options({"kvmesh": {"tenant": "acme", "skip_save": True}})
    assert (opts.tenant, opts.skip_save, problem) == ("acme", True, None)
    for bad in ({"tenat": "a"}, {"tenant": 3}, {"tenant": "a\x00b"}, "nope"):
        opts, problem = parse_request_options({"kvmesh": bad})
        assert opts == NO_CACHE and problem


# -- scheduler ----------------------------------------------------------------------------------


class FakeClient:
    def __init__(self, hits: int = 0, fail: bool = False) -> None:
        self.hits, self.fail = hits, fail
        self.lookups: list[tuple[int, str, str]] = []
        self.released: list[str] = []

    def lookup(self, tokens, lookup_id: str, *, tenant: str = "", **_: object) -> int:
        if self.fail:
            raise RuntimeError("boom")
        self.lookups.append((len(tokens), lookup_id, tenant))
        return min(self.hits, len(tokens) // CHUNK * CHUNK)

    def release(self, lookup_id: str) -> None:
        self.released.append(lookup_id)

    def close(self) -> None:
        pass


def request(rid: str, n: int, params: dict | None = None, seed: int = 0) -> SimpleNamespace:
    tokens = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        all_token_ids=tokens,
        num_tokens=n,
        num_prompt_tokens=n,
        kv_transfer_params=params,
        mm_features=[],
        lora_request=None,
        prompt_embeds=None,
    )


def new_step(req, blocks: list[int], computed: int, scheduled: int, cached=None):
    cached = cached or SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=computed
            )
        ]
        if req is not None
        else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={**({req.request_id: scheduled} if req else {})},
    )


def sched(client: FakeClient, **kw) -> SchedulerSide:
    from kvmesh.common.config import EngineConfig

    return SchedulerSide(EngineConfig(chunk_size=CHUNK, **kw), client)  # type: ignore[arg-type]


def test_miss_plans_a_save_of_full_chunks() -> None:
    client = FakeClient(hits=0)
    s = sched(client)
    req = request("r", 100)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, 0)
    meta = s.build_connector_meta(new_step(req, list(range(7)), 0, 100))
    assert meta.loads == []
    (save,) = meta.saves
    assert save.tokens.tolist() == req.all_token_ids[:96] and save.skip == 0
    assert save.block_ids == list(range(7))
    assert s.request_finished(req) == (
        False,
        {"kvmesh_result": {"hit_tokens": 0, "saved_tokens": 96}},
    )
    assert client.released == []


def test_hit_plans_a_load_and_no_second_save() -> None:
    client = FakeClient(hits=64)
    s = sched(client)
    req = request("r", 100, {"kvmesh": {"tenant": "t"}})
    assert s.get_num_new_matched_tokens(req, 0) == (64, False)
    assert client.lookups == [(100, "r", "t")]
    s.update_state_after_alloc(req, 64)
    meta = s.build_connector_meta(new_step(req, [5, 6, 7, 8, 9, 10, 11], 64, 36))
    (load,) = meta.loads
    assert (load.req_id, load.skip, load.tenant, len(load.tokens)) == ("r", 0, "t", 64)
    (save,) = meta.saves  # chunk [64, 96) is new
    assert (save.skip, len(save.tokens)) == (64, 96)
    assert s.build_connector_meta(new_step(None, [], 0, 0)).loads == []  # loaded once
    s.request_finished(req)
    assert client.released == ["r"]


def test_whole_prompt_cached_leaves_the_last_token_to_vllm() -> None:
    s = sched(FakeClient(hits=10_000))
    req = request("r", 96)
    assert s.get_num_new_matched_tokens(req, 0) == (95, False)
    s.update_state_after_alloc(req, 95)
    (load,) = s.build_connector_meta(new_step(req, list(range(6)), 95, 1)).loads
    assert len(load.tokens) == 96  # whole chunks: token 95 is loaded and recomputed


def test_local_prefix_hit_is_skipped_to_the_chunk_boundary() -> None:
    client = FakeClient(hits=96)
    s = sched(client)
    req = request("r", 100)
    assert s.get_num_new_matched_tokens(req, 48) == (48, False)
    s.update_state_after_alloc(req, 48)
    (load,) = s.build_connector_meta(new_step(req, list(range(7)), 96, 4)).loads
    assert (load.skip, len(load.tokens)) == (32, 96)
    # vLLM had it all already: nothing to load, pins released at once
    req2 = request("r2", 100)
    assert s.get_num_new_matched_tokens(req2, 96) == (0, False)
    assert client.released == ["r2"]


def test_chunked_prefill_saves_each_step_what_it_completes() -> None:
    s = sched(FakeClient(hits=0))
    req = request("r", 100)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, 0)
    (first,) = s.build_connector_meta(new_step(req, [0, 1, 2], 0, 40)).saves
    assert (first.skip, len(first.tokens), first.block_ids) == (0, 32, [0, 1, 2])
    cached = SimpleNamespace(
        req_ids=["r"],
        resumed_req_ids=set(),
        new_block_ids=[([3, 4, 5, 6],)],
        num_computed_tokens=[40],
    )
    out = new_step(None, [], 0, 0, cached)
    out.num_scheduled_tokens = {"r": 60}
    (second,) = s.build_connector_meta(out).saves
    assert (second.skip, len(second.tokens)) == (32, 96)
    assert second.block_ids == [0, 1, 2, 3, 4, 5, 6]
    # resumed after preemption: the block table is replaced
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([9],)], num_computed_tokens=[100]
    )
    out = new_step(None, [], 0, 0, cached)
    out.num_scheduled_tokens = {"r": 1}
    assert s.build_connector_meta(out).saves == []


def test_request_options_gate_lookups_and_saves() -> None:
    client = FakeClient(hits=64)
    s = sched(client)
    no_load = request("a", 100, {"kvmesh": {"skip_load": True}})
    assert s.get_num_new_matched_tokens(no_load, 0) == (0, False)
    no_save = request("b", 100, {"kvmesh": {"skip_save": True}})
    s.get_num_new_matched_tokens(no_save, 0)
    s.update_state_after_alloc(no_save, 0)
    assert s.build_connector_meta(new_step(no_save, list(range(7)), 0, 100)).saves == []
    bad = request("c", 100, {"kvmesh": {"tenat": "x"}})
    assert s.get_num_new_matched_tokens(bad, 0) == (0, False)
    s.update_state_after_alloc(bad, 0)
    assert s.build_connector_meta(new_step(bad, list(range(7)), 0, 100)).saves == []
    embeds = request("d", 100)
    embeds.prompt_embeds = torch.zeros(1)
    assert s.get_num_new_matched_tokens(embeds, 0) == (0, False)
    logprobs = request("e", 100)  # prompt logprobs: vLLM reads no cache for it
    logprobs.skip_reading_prefix_cache = True
    assert s.get_num_new_matched_tokens(logprobs, 0) == (0, False)
    s.update_state_after_alloc(logprobs, 0)
    assert len(s.build_connector_meta(new_step(logprobs, list(range(7)), 0, 100)).saves) == 1
    assert [lk[1] for lk in client.lookups] == ["b"]


def test_vllm_cache_salt_isolates_kvmesh_too() -> None:
    client = FakeClient(hits=64)
    s = sched(client)

    def tenant_of(rid: str, salt: str | None, params: dict | None = None) -> str:
        r = request(rid, 100, params)
        r.cache_salt = salt
        s.get_num_new_matched_tokens(r, 0)
        return client.lookups[-1][2]

    a, b, none, a2 = (tenant_of(*c) for c in (("1", "a"), ("2", "b"), ("3", None), ("4", "a")))
    assert a == a2 and a != b and none == "" and tenant_of("5", "") == ""
    assert a.startswith(SALTED) and b.startswith(SALTED)
    # A tenant of the request's own keeps salted and unsalted apart too.
    acme_a = tenant_of("6", "a", {"kvmesh": {"tenant": "acme"}})
    assert (
        acme_a not in (a, "acme") and tenant_of("7", None, {"kvmesh": {"tenant": "acme"}}) == "acme"
    )
    # No request can name a salted tenant itself.
    opts, problem = parse_request_options({"kvmesh": {"tenant": a}})
    assert opts == NO_CACHE and "may not start with" in problem


def test_lookup_errors_are_misses() -> None:
    s = sched(FakeClient(fail=True))
    assert s.get_num_new_matched_tokens(request("r", 100), 0) == (0, False)


def test_roles_limit_what_is_planned() -> None:
    from kvmesh.common.config import EngineConfig

    consumer = SchedulerSide(EngineConfig(chunk_size=CHUNK), FakeClient(64), can_save=False)  # type: ignore[arg-type]
    req = request("r", 100)
    consumer.get_num_new_matched_tokens(req, 0)
    consumer.update_state_after_alloc(req, 0)
    assert consumer.build_connector_meta(new_step(req, list(range(7)), 0, 100)).saves == []
    producer = SchedulerSide(EngineConfig(chunk_size=CHUNK), FakeClient(64), can_load=False)  # type: ignore[arg-type]
    assert producer.get_num_new_matched_tokens(request("p", 100), 0) == (0, False)


# -- worker -------------------------------------------------------------------------------------


def paged(blocks: int = 16, heads: int = 2, head_dim: int = 16) -> dict[str, torch.Tensor]:
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, heads, BLOCK, 2 * head_dim)
        for i in reversed(range(LAYERS))  # vLLM's dict need not be in layer order
    }
    for t in caches.values():
        random_fill(t)
    return caches


def rows(caches: dict[str, torch.Tensor], block_ids: list[int], n: int) -> list[torch.Tensor]:
    slots = slot_mapping(block_ids, BLOCK, n)
    out = []
    for name in sorted(caches):
        t = caches[name]
        out.append(bits(t[slots // BLOCK, :, slots % BLOCK].clone()))
    return out


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch):
    """Two single-rank instances: one saves, the other loads (as two vLLM processes
    would through a shared tier; here the saving engine's L1 is read by the loader)."""
    # a short directory: pytest's tmp_path can exceed the 107-byte socket path limit
    d = Path(tempfile.mkdtemp(prefix="kvm-w", dir="/tmp"))
    monkeypatch.setenv("KVMESH_IPC_DIR", str(d))
    from kvmesh.common.config import EngineConfig, L1Config

    made = []

    def make(layerwise: bool = False, events: bool = False) -> WorkerSide:
        cfg = EngineConfig(
            chunk_size=CHUNK,
            model_name="m",
            layerwise=layerwise,
            l1=L1Config(max_size=8 << 20, reserve=0),
        )
        w = WorkerSide(cfg, "inst", 0, 1, BLOCK, events_enabled=events)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()
    destroy_all_engines()
    shutil.rmtree(d, ignore_errors=True)


def tokens(n: int) -> torch.Tensor:
    return torch.arange(1000, 1000 + n, dtype=torch.int32)


def run_step(w: WorkerSide, meta: KvmeshConnectorMetadata, layer_names: list[str]) -> set[int]:
    """What vLLM's model runner does around one forward pass."""
    w.begin_step(meta)
    w.start_load_kv()
    for name in layer_names:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save()
    failed = w.take_failed_blocks()
    w.end_step()
    return failed


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_save_then_load_is_bitwise_exact(workers, layerwise: bool) -> None:
    src_caches, dst_caches = paged(), paged()
    names = sorted(src_caches)
    w = workers(layerwise=layerwise)
    w.register_kv_caches(src_caches)
    src_blocks, dst_blocks = [3, 9, 1, 12, 7], [0, 2, 4, 6, 8, 10]
    save = SaveOp("r", tokens(70), src_blocks, 0)
    assert run_step(w, KvmeshConnectorMetadata(saves=[save]), names) == set()
    assert w.engine.lookup(tokens(70)) == 64
    # The same engine loads into other blocks (its cache is a second paged tensor).
    w.engine.register_kv_caches(dst_caches)
    load = LoadOp("r", tokens(64), dst_blocks, 0)
    w.engine.lookup(tokens(64), "r")
    assert "r" in w.engine.pins
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), names) == set()
    for got, want in zip(
        rows(dst_caches, dst_blocks, 64), rows(src_caches, src_blocks, 64), strict=True
    ):
        assert torch.equal(got, want)
    assert "r" not in w.engine.pins  # the load consumed the lookup's pins


def test_layerwise_load_follows_the_model_layer_by_layer(workers) -> None:
    src_caches, dst_caches = paged(), paged()
    names = sorted(src_caches)
    w = workers(layerwise=True)
    w.register_kv_caches(src_caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("r", tokens(64), [1, 2, 3, 4])]), names)
    w.engine.register_kv_caches(dst_caches)
    before = rows(dst_caches, [5, 6, 7, 8], 64)
    w.begin_step(KvmeshConnectorMetadata(loads=[LoadOp("r", tokens(64), [5, 6, 7, 8])]))
    w.start_load_kv()
    after0 = rows(dst_caches, [5, 6, 7, 8], 64)
    want = rows(src_caches, [1, 2, 3, 4], 64)
    assert torch.equal(after0[0], want[0]) and torch.equal(after0[1], before[1])
    w.wait_for_layer_load(names[0])
    assert torch.equal(rows(dst_caches, [5, 6, 7, 8], 64)[1], before[1])
    w.wait_for_layer_load(names[1])
    assert torch.equal(rows(dst_caches, [5, 6, 7, 8], 64)[1], want[1])
    assert w.take_failed_blocks() == set()
    w.end_step()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_missing_chunks_report_their_blocks(workers, layerwise: bool) -> None:
    caches = paged()
    names = sorted(caches)
    w = workers(layerwise=layerwise)
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("r", tokens(32), [0, 1])]), names)
    # 96 tokens (blocks 4-9) expected, only the first chunk (blocks 4, 5) is there
    load = LoadOp("r", tokens(96), [4, 5, 6, 7, 8, 9, 10], 0)
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), names) == {6, 7, 8, 9}
    # with a skipped prefix, the failure starts past it
    load = LoadOp("r2", torch.arange(5000, 5064, dtype=torch.int32), [1, 2, 3, 4], 32)
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), names) == {3, 4}


def test_too_few_blocks_fail_the_load_not_the_step(workers) -> None:
    caches = paged()
    w = workers()
    w.register_kv_caches(caches)
    load = LoadOp("r", tokens(64), [1], 0)
    assert run_step(w, KvmeshConnectorMetadata(loads=[load]), sorted(caches)) == {1}


def test_tenant_save_is_invisible_to_other_tenants(workers) -> None:
    caches = paged()
    w = workers()
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("r", tokens(64), [0, 1, 2, 3], 0, "a")]), [])
    assert w.engine.lookup(tokens(64), tenant="a") == 64
    assert w.engine.lookup(tokens(64), tenant="b") == 0
    assert w.engine.lookup(tokens(64)) == 0


def test_events_carry_chunk_hashes_and_tokens(workers) -> None:
    caches = paged()
    w = workers(events=True)
    w.register_kv_caches(caches)
    run_step(w, KvmeshConnectorMetadata(saves=[SaveOp("r", tokens(64), [0, 1, 2, 3])]), [])
    events = w.take_events()
    assert isinstance(events, KvmeshKVEvents)
    stored = events.get_all_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    first, second = stored
    assert first.token_ids == list(range(1000, 1032)) and first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[0]
    assert (first.block_size, first.medium, first.ownership) == (CHUNK, "CPU", "kvmesh:l1")
    assert w.take_events() is None
    w.engine.clear()  # the chunks stored go: a router must hear it
    w.engine.store(tokens(32), torch.arange(32))
    w.engine.storage.remove(w.engine.chunks(tokens(32))[0][2])
    # vLLM's aggregator counts equal events together (a Counter), so order is only
    # kept between distinct ones: count them.
    kinds = collections.Counter(type(e) for e in w.take_events().get_all_events())
    cleared = sum(len(e.block_hashes) for e in stored)
    assert kinds == {BlockRemoved: cleared + 1, BlockStored: 1}


def test_events_never_name_a_tenants_chunks(workers) -> None:
    """A tenant's chunk has the same chunk hash as any other tenant's copy: published,
    a router would merge tenants. Only the engine's own namespace is published."""
    caches = paged()
    w = workers(events=True)
    w.register_kv_caches(caches)
    saves = [
        SaveOp("a", tokens(64), [0, 1, 2, 3], 0, "alice"),
        SaveOp("b", tokens(64), [4, 5, 6, 7]),
    ]
    run_step(w, KvmeshConnectorMetadata(saves=saves), [])
    assert w.engine.lookup(tokens(64), tenant="alice") == 64  # stored, not published
    stored = w.take_events().get_all_events()
    assert len(stored) == 2 and all(isinstance(e, BlockStored) for e in stored)
    assert stored[0].token_ids == list(range(1000, 1032))
    w.engine.storage.remove(w.engine.chunks(tokens(64), tenant="alice")[0][2])
    assert w.take_events() is None


def test_events_of_all_workers_are_kept_only_when_common() -> None:
    a = BlockStored(
        block_hashes=[b"a" * 16], parent_block_hash=None, token_ids=[1], block_size=1,
        lora_id=None, medium="CPU", lora_name=None,
    )  # fmt: skip
    b = BlockRemoved(block_hashes=[b"b" * 16], medium="CPU")
    merged = KvmeshKVEvents(num_workers=1)
    merged.add_events([a, b])
    merged.add_events([a])
    merged.increment_workers(1)
    assert merged.aggregate().get_all_events() == [a]


def test_layer_order() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.0.attn"]
    assert layer_order(names) == {names[2]: 0, names[1]: 1, names[0]: 2}
    assert layer_order(["a.1.b.2", "c"]) == {"a.1.b.2": 0, "c": 1}
