"""Request and lookup ids on log lines: the vLLM worker side binds vLLM's request id
while it loads or saves a request, and work the engine hands its loop runs under the
caller's bound ids (asyncio copies the submitting thread's context), so a lower
tier's warning logged on the loop names the request."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
from kvtest.paged import make_cache
from structlog.testing import LogCapture

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.services.worker.builder import destroy_all_engines
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.vllm.metadata import KvmeshConnectorMetadata, LoadOp, SaveOp
from kvmesh.services.worker.vllm.worker import WorkerSide

CHUNK, BLOCK = 16, 16


@pytest.fixture
def captured() -> Iterator[LogCapture]:
    """Every structlog line as a dict, with the bound context merged in (as the real
    configuration does)."""
    cap = LogCapture()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, cap])
    try:
        yield cap
    finally:
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()


async def _bound() -> dict:
    return structlog.contextvars.get_contextvars()


def test_the_loop_runs_work_under_the_callers_bound_ids() -> None:
    loop = LoopThread("ctx-test")
    try:
        with structlog.contextvars.bound_contextvars(request_id="r-1", lookup_id="l-1"):
            assert loop.run(_bound(), 5) == {"request_id": "r-1", "lookup_id": "l-1"}
        assert loop.run(_bound(), 5) == {}  # nothing leaks into later work
    finally:
        loop.stop()


class FailingTier:
    """A lower tier whose every get raises (the engine must log and miss)."""

    name = "failing"

    async def aget(self, key, allocator):
        raise OSError("device gone")

    def batched_contains(self, keys, pin=False) -> int:
        return 0

    def submit_put(self, key, obj) -> None:
        return None

    def unpin(self, key) -> bool:
        return False

    def flush(self, timeout=None) -> bool:
        return True

    def close(self) -> None:
        return None


def test_a_tier_warning_on_the_loop_names_the_request(captured: LogCapture) -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=8, block_size=4)
    cfg = EngineConfig(chunk_size=8, model_name="ctx", l1=L1Config(max_size=4 << 20, reserve=0))
    eng = KVEngine("ctx", 0, cfg, view, lower_tiers=[FailingTier()])
    try:
        with structlog.contextvars.bound_contextvars(request_id="cmpl-abc"):
            assert not bool(eng.retrieve(list(range(16)), torch.arange(16)).any())
    finally:
        eng.close()
    failed = [e for e in captured.entries if e["event"] == "tier get failed"]
    assert len(failed) == 2  # one per chunk
    assert all(e["request_id"] == "cmpl-abc" and e["tier"] == "failing" for e in failed)


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerSide]:
    d = Path(tempfile.mkdtemp(prefix="kvm-ctx", dir="/tmp"))  # short: a socket path
    monkeypatch.setenv("KVMESH_IPC_DIR", str(d))
    cfg = EngineConfig(chunk_size=CHUNK, model_name="m", l1=L1Config(max_size=8 << 20, reserve=0))
    w = WorkerSide(cfg, "ctx-inst", 0, 1, BLOCK)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 2, BLOCK, 32) for i in range(2)}
    w.register_kv_caches(caches)
    try:
        yield w
    finally:
        w.shutdown()
        destroy_all_engines()
        shutil.rmtree(d, ignore_errors=True)


def test_the_worker_side_binds_the_request_id_around_its_engine_calls(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, object]] = []
    engine: KVEngine = worker.engine
    store, retrieve = engine.store, engine.retrieve

    def spy(name, fn):
        def call(*args, **kwargs):
            seen.append((name, structlog.contextvars.get_contextvars().get("request_id")))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(engine, "store", spy("store", store))
    monkeypatch.setattr(engine, "retrieve", spy("retrieve", retrieve))
    tokens = torch.arange(100, 132, dtype=torch.int32)
    for meta in (
        KvmeshConnectorMetadata(saves=[SaveOp("req-save", tokens, [0, 1])]),
        KvmeshConnectorMetadata(loads=[LoadOp("req-load", tokens, [2, 3], 0)]),
    ):
        worker.begin_step(meta)
        worker.start_load_kv()
        worker.wait_for_save()
        assert worker.take_failed_blocks() == set()
        worker.end_step()
    assert seen == [("store", "req-save"), ("retrieve", "req-load")]
    assert structlog.contextvars.get_contextvars() == {}
