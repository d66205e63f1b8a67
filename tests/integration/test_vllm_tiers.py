"""Tiers that outlive a vLLM process, end to end: vLLM process A serves a prompt and
exits; a fresh process B (another instance id, and another L1 size: another config)
serves it again and loads its KV from the disk tier, the kvmesh cache-server or a
Redis Cluster. B's outputs must equal plain vLLM's exactly. Killing the cache-server
while B runs only makes B recompute.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from kvtest.remote import CacheServerProcess, RedisCluster
from vllm_fixture import PROMPTS, Step, connector_config, run_session

from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

pytestmark = pytest.mark.timeout(900)

P = PROMPTS["p1000"]


def b_config(a: dict) -> dict:
    """A's connector config with another instance id and a smaller L1."""
    engine = dict(a["config"]["engine"])
    engine["l1"] = {**engine["l1"], "max_size": "64MiB"}
    return {"instance_id": a["instance_id"] + "-b", "config": {"engine": engine}}


def check_b_reuses(a, b, reference) -> None:
    assert a.steps[0].hit_tokens == 0 and a.steps[0].kvmesh["saved_tokens"] == 768
    assert b.steps[0].hit_tokens == 768  # L1 of a fresh process is empty: from the tier
    assert b.steps[0].num_cached_tokens == 768
    assert a.steps[0].logprobs[0] == reference.cold("p1000").logprobs[0]
    assert b.steps[0].logprobs[0] == reference.split("p1000", 768).logprobs[0]
    assert b.steps[0].output_tokens == reference.cold("p1000").output_tokens


def test_disk_a_then_b(serve_a_then_b, reference, tmp_path: Path) -> None:
    conn = connector_config(disk={"enabled": True, "path": str(tmp_path), "max_size": "64MiB"})
    a, b = serve_a_then_b([Step(P)], conn, b_config(conn))
    check_b_reuses(a, b, reference)
    # A's engine directory holds the three chunk files B read.
    files = [f for f in tmp_path.rglob("*") if f.is_file() and not f.name.startswith(".")]
    assert len([f for f in files if f.suffix != ".lock"]) >= 3


def test_cacheserver_a_then_b(serve_a_then_b, reference, tmp_path: Path) -> None:
    server = CacheServerProcess(tmp_path).start()
    try:
        conn = connector_config(remote={"enabled": True, "url": server.url, "timeout_s": 5})
        a, b = serve_a_then_b([Step(P)], conn, b_config(conn))
        check_b_reuses(a, b, reference)
        assert server.alive()
    finally:
        server.stop()


def test_redis_cluster_a_then_b(serve_a_then_b, reference, tmp_path: Path) -> None:
    cluster = RedisCluster(tmp_path).start()
    try:
        conn = connector_config(remote={"enabled": True, "url": cluster.url, "timeout_s": 5})
        a, b = serve_a_then_b([Step(P)], conn, b_config(conn))
        check_b_reuses(a, b, reference)
    finally:
        cluster.stop()


def test_cacheserver_killed_while_b_runs_only_makes_b_recompute(
    tiny_model, reference, tmp_path: Path
) -> None:
    """A stores P and Q through the cache-server. B loads P from it; then the server is
    killed (SIGKILL, while B pauses before its next request): B's request for Q
    recomputes and answers exactly; so does P again, from B's own L1."""
    server = CacheServerProcess(tmp_path).start()
    q = prompt_tokens(1000, seed=11)
    try:
        conn = connector_config(remote={"enabled": True, "url": server.url, "timeout_s": 1})
        a = run_session(tiny_model, [Step(P), Step(q)], connector=conn)
        assert [s.kvmesh["saved_tokens"] for s in a.steps] == [768, 768]

        def kill_on_pause(line: str) -> None:
            if line.startswith("kvmesh-session: step 1 pausing") and server.alive():
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait(10)

        b = run_session(
            tiny_model,
            [Step(P), Step(q, pause_s=2.0), Step(P)],
            connector=b_config(conn),
            progress=kill_on_pause,
        )
        assert not server.alive()
        loaded, after_kill, again = b.steps
        assert loaded.hit_tokens == 768
        # Either B's lookup finds the server gone (0 hits) or the load that follows fails
        # and vLLM recomputes the blocks: the answer is exact either way.
        assert after_kill.hit_tokens == 0 or b.engine["load_errors"] > 0
        assert after_kill.output_tokens == a.steps[1].output_tokens
        assert after_kill.logprobs[0] == a.steps[1].logprobs[0]
        assert again.hit_tokens == 768  # L1 kept serving
        for step in (loaded, again):
            assert step.logprobs[0] == reference.split("p1000", 768).logprobs[0]
        # The request that met the dead server waited at most about its deadline.
        assert after_kill.seconds < 1.0 + 5 * a.steps[1].seconds + 2.0
    finally:
        server.stop()


def test_weights_changed_by_hf_overrides_never_share_chunks(tiny_model, tmp_path: Path) -> None:
    """The same weights with another rotary base (vLLM's hf_overrides) compute other K:
    B, so configured, must not load what A stored under the same path, and stores its
    own; a fresh C with B's overrides loads B's."""
    conn = connector_config(disk={"enabled": True, "path": str(tmp_path), "max_size": "64MiB"})
    rope = {"hf_overrides": {"rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}}
    a = run_session(tiny_model, [Step(P)], connector=conn)
    b = run_session(tiny_model, [Step(P)], connector=b_config(conn), llm_kwargs=rope)
    c = run_session(tiny_model, [Step(P)], connector=b_config(b_config(conn)), llm_kwargs=rope)
    assert a.steps[0].kvmesh["saved_tokens"] == 768
    assert b.steps[0].hit_tokens == 0 and b.steps[0].kvmesh["saved_tokens"] == 768
    # A hit would have been wrong: the two variants answer differently.
    assert b.steps[0].logprobs[0] != a.steps[0].logprobs[0]
    assert c.steps[0].hit_tokens == 768
    assert c.steps[0].output_tokens == b.steps[0].output_tokens
    files = [f for f in tmp_path.rglob("*") if f.is_file() and not f.name.startswith(".")]
    assert len([f for f in files if f.suffix != ".lock"]) == 6
