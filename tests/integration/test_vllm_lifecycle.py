"""The connector under vLLM's request life cycle, in a real vLLM on CPU (tiny model):
aborts while a request waits with pinned chunks or is mid-prefill, preemption and
resumption, vLLM's own prefix cache together with kvmesh, lookups that fail, and a
load counted at lookup that the scheduler then cannot plan.

vLLM on CPU schedules synchronously (its CPU executor turns async scheduling off), so
an abort lands between steps: before a request's load (it waits for blocks) or after
it (mid-prefill).

Each mode is one vLLM process driving its engine step by step (`LLMEngine.add_request`,
`step`, `abort_request`): this file is also the child's script (run as
`python test_vllm_lifecycle.py SPEC OUT`). 24 KV blocks of 128 tokens and at most 512
tokens a step, so that requests wait for blocks, get preempted and prefill over several
steps. The reference outputs come from the same process with kvmesh switched off per
request (skip_load and skip_save), greedy, compared token for token.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_fixture import connector_config

from kvmesh.services.worker.vllm.testing import vllm_env

# Four vLLM processes (two modes, whole and layerwise loads; ~20 s each to start on 2
# cores) serve every scenario below.
pytestmark = pytest.mark.timeout(600)

NOCACHE = {"kvmesh": {"skip_load": True, "skip_save": True}}


# -- the child: one vLLM process ------------------------------------------------------------


class _Probe:
    """Records the engine's retrieves and stores (whole or layer by layer) as
    [op, lookup id, skipped tokens, tokens, tokens loaded or stored], and can lose a
    load's chunks just before it runs (as if evicted after the lookup)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.drop: str | None = None

    def install(self) -> None:
        from kvmesh.services.worker.engine import KVEngine

        probe = self

        def record(op: str, lookup_id: str | None, mask: Any, n: int, done: Any) -> None:
            skip = int((~mask).sum()) if mask is not None else 0
            done = int(done.sum()) if hasattr(done, "sum") else int(done)
            probe.calls.append([op, lookup_id, skip, n, done])

        def lose(engine: KVEngine, tokens: Any, mask: Any, lookup_id: str, tenant: str) -> None:
            if probe.drop is None:
                return
            chunks = engine.chunks(tokens, mask, tenant=tenant)
            engine.release_lookup(lookup_id)
            for _, _, key in chunks[-1:] if probe.drop == "last" else chunks:
                engine.storage.remove(key)
            probe.drop = None

        def wrap(name: str, op: str, layered: bool) -> None:
            original = getattr(KVEngine, name)

            @functools.wraps(original)
            def call(self, tokens, slot_mapping, mask=None, **kw):
                lookup_id = kw.get("lookup_id")
                if op == "retrieve":
                    lose(self, tokens, mask, lookup_id, kw.get("tenant", ""))
                done = original(self, tokens, slot_mapping, mask, **kw)
                if not layered:
                    record(op, lookup_id, mask, len(tokens), done)
                    return done

                def layers():
                    result = yield from done
                    record(op, lookup_id, mask, len(tokens), result)
                    return result

                return layers()

            setattr(KVEngine, name, call)

        wrap("retrieve", "retrieve", False)
        wrap("store", "store", False)
        wrap("retrieve_layer", "retrieve", True)
        wrap("store_layer", "store", True)

    def take(self) -> list[list[Any]]:
        calls, self.calls = self.calls, []
        return calls


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    probe = _Probe()
    probe.install()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvmesh.services.worker.builder import get_engine
    from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

    mode = spec["mode"]
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=2048,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=512,
        enable_prefix_caching=mode == "prefix",
        **spec.get("llm_kwargs", {}),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvmeshConnector",
            kv_connector_module_path="kvmesh.services.worker.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        ),
    )
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    side = sched.connector._scheduler
    kvm = get_engine(spec["connector"]["instance_id"], 0)
    out: dict[str, Any] = {}

    def params(n: int, kv: dict | None = None) -> SamplingParams:
        extra = {"kv_transfer_params": kv} if kv else None
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)

    def prompt(tokens: list[int], salt: str | None = None) -> dict[str, Any]:
        return {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}

    def gen(tokens: list[int], n: int, kv: dict | None = None, salt: str | None = None) -> dict:
        t = time.perf_counter()
        o = llm.generate([prompt(tokens, salt)], params(n, kv), use_tqdm=False)[0]
        return result(o, time.perf_counter() - t)

    def result(o: Any, seconds: float = 0.0) -> dict[str, Any]:
        kvmesh = (o.kv_transfer_params or {}).get("kvmesh_result") or {}
        return {
            "tokens": list(o.outputs[0].token_ids),
            "hit": kvmesh.get("hit_tokens", 0),
            "saved": kvmesh.get("saved_tokens", 0),
            "cached": o.num_cached_tokens or 0,
            "seconds": seconds,
        }

    def drain() -> tuple[dict[str, dict], int]:
        done, preempted = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = result(o)
            preempted = max(preempted, sum(r.num_preemptions for r in sched.running))
        return done, preempted

    def state() -> dict[str, Any]:
        objs = list(kvm.storage.l1._objs.values())
        return {
            "pinned_keys": {k: len(v[1]) for k, v in list(kvm.pins._held.items()) if v[1]},
            "l1_pins": sum(o.pin_count for o in objs),
            "l1_extra_refs": sum(o.ref_count - 1 for o in objs),
            "connector_requests": len(side._reqs),
            "calls": probe.take(),
        }

    def settled() -> dict[str, Any]:
        """The state once the releases sent have arrived: the scheduler's release is a
        message to the engine's lookup server, not a call."""
        calls, t0 = probe.take(), time.monotonic()
        while any(keys for _, keys in list(kvm.pins._held.values())) and time.monotonic() - t0 < 2:
            time.sleep(0.01)
        return {**state(), "calls": calls, "waited_s": time.monotonic() - t0}

    P = prompt_tokens(1000, seed=1)
    if mode == "plain":
        out["ref_p"] = gen(P, 1, NOCACHE)
        out["store_p"] = gen(P, 1)
        probe.take()

        # A request that counted a hit but waits for blocks, then is aborted.
        A, B = prompt_tokens(1000, seed=11), prompt_tokens(1000, seed=12)
        eng.add_request("A", prompt(A), params(30, NOCACHE))
        eng.add_request("B", prompt(B), params(30, NOCACHE))
        for _ in range(4):
            eng.step()
        eng.add_request("W", prompt(P), params(5))
        for _ in range(2):
            eng.step()
        out["waiting"] = {
            "waiting": len(sched.waiting),
            "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            **state(),
        }
        eng.abort_request(["W"])
        out["waiting_aborted"] = settled()
        eng.abort_request(["A", "B"])
        eng.step()
        out["after_waiting"] = gen(P, 1)
        out["after_waiting_state"] = settled()

        # Aborted mid-prefill: loaded, then two of its 512-token steps saved.
        Q = P + prompt_tokens(1000, seed=21)
        out["ref_q"] = gen(Q, 1, NOCACHE)
        probe.take()
        eng.add_request("Q", prompt(Q), params(5))
        eng.step()
        eng.step()
        out["mid_prefill"] = settled()
        eng.abort_request(["Q"])
        out["mid_prefill_aborted"] = settled()
        out["q_again"] = gen(Q, 1)
        out["q_again_state"] = settled()

        # Preemption: three 700-token prompts growing by 400 tokens need 27 blocks.
        R = [prompt_tokens(700, seed=30 + i) for i in range(3)]
        out["ref_r"] = [gen(r, 400, NOCACHE) for r in R]
        probe.take()
        for i, r in enumerate(R):
            eng.add_request(f"R{i}", prompt(r), params(400))
        done, out["preemptions"] = drain()
        out["r"] = [done[f"R{i}"] for i in range(3)]
        out["r_state"] = settled()
        out["r_again"] = [gen(r, 400) for r in R]
        out["r_again_state"] = settled()

        # Lookups that fail: the engine's loop busy, its storage failing, no server.
        def busy() -> None:
            time.sleep(2.0)  # blocks the engine's event loop thread

        async def hog() -> None:
            busy()

        kvm.loop.submit(hog())
        time.sleep(0.1)
        out["loop_busy"] = gen(P, 1)
        time.sleep(2.0)
        out["loop_busy_after"] = gen(P, 1)

        def broken(*_: object, **__: object) -> None:
            raise OSError("tier dead")

        kvm.storage.prefix_hits = broken
        out["storage_broken"] = gen(P, 1)
        del kvm.storage.prefix_hits
        out["storage_back"] = gen(P, 1)

        from kvmesh.services.worker.lookup_server import LookupServer, attach_lookup_server

        (server,) = [
            h.__self__
            for h in kvm._close_hooks
            if isinstance(getattr(h, "__self__", None), LookupServer)
        ]
        server.stop()
        out["no_server"] = gen(P, 1)
        attach_lookup_server(kvm)
        time.sleep(1.5)  # the scheduler's socket reconnects (backoff up to 1 s)
        out["server_back"] = gen(P, 1)

        # A load counted at lookup that the scheduler then cannot plan.
        from kvmesh.services.worker.vllm import scheduler as planner

        def unplannable(_: object) -> None:
            raise RuntimeError("injected: no plan")

        out["ref_p8"] = gen(P, 8, NOCACHE)
        gen(prompt_tokens(1000, seed=50), 1, NOCACHE)  # other KV in the free blocks
        planner.token_tensor, token_tensor = unplannable, planner.token_tensor
        out["unplanned"] = gen(P, 8)
        planner.token_tensor = token_tensor
        out["after_unplanned"] = gen(P, 8)
        out["end_state"] = settled()
    else:
        out["ref_p"] = gen(P, 20, NOCACHE, salt="ref")
        # kvmesh keeps salts apart as vLLM does: P stored under salt b, and forgotten
        # by vLLM's own cache, is no hit under salt a.
        out["p_b_first"] = gen(P, 20, salt="b")
        llm.reset_prefix_cache()
        out["p_a"] = gen(P, 20, salt="a")
        llm.reset_prefix_cache()
        # X shares P's first 400 tokens: under salt b, vLLM caches 3 of P's blocks
        X = P[:400] + prompt_tokens(600, seed=40)
        out["x_b"] = gen(X, 1, salt="b")
        probe.take()
        out["p_b"] = gen(P, 20, salt="b")
        out["p_b_state"] = settled()
        # The same, but the load of the chunk across vLLM's hit fails while Y, which
        # shares vLLM's blocks of that chunk, is running.
        Y = P[:400] + prompt_tokens(600, seed=41)
        out["ref_y"] = gen(Y, 30, NOCACHE, salt="ref-y")
        gen(P, 1, salt="c")  # kvmesh holds P under salt c; vLLM then forgets it
        llm.reset_prefix_cache()
        eng.add_request("Y", prompt(Y, "c"), params(30))
        for _ in range(4):
            eng.step()
        probe.take()
        probe.drop = "all"
        eng.add_request("Pc", prompt(P, "c"), params(20))
        done, _ = drain()
        out["y_c"], out["p_c"] = done["Y"], done["Pc"]
        out["p_c_state"] = settled()
    return out


# -- the tests ------------------------------------------------------------------------------


def _serve(model: Path, mode: str, layerwise: bool) -> tuple[dict[str, Any], str]:
    work = Path(tempfile.mkdtemp(prefix="kvmesh-lc-"))
    env = vllm_env(work)
    try:
        connector = connector_config(layerwise=layerwise)
        spec = {"model": str(model), "mode": mode, "connector": connector}
        (work / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, __file__, str(work / "spec.json"), str(work / "out.json")],
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
        )
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        return json.loads((work / "out.json").read_text()), log
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(env["KVMESH_IPC_DIR"], ignore_errors=True)


@pytest.fixture(scope="module", params=["whole", "layerwise"])
def plain(request: pytest.FixtureRequest, tiny_model: Path) -> tuple[dict[str, Any], str]:
    return _serve(tiny_model, "plain", request.param == "layerwise")


@pytest.fixture(scope="module", params=["whole", "layerwise"])
def prefix(request: pytest.FixtureRequest, tiny_model: Path) -> tuple[dict[str, Any], str]:
    return _serve(tiny_model, "prefix", request.param == "layerwise")


def no_pins_left(state: dict[str, Any]) -> None:
    assert state["pinned_keys"] == {}
    assert state["l1_pins"] == 0 and state["l1_extra_refs"] == 0
    assert state["connector_requests"] == 0


def test_abort_while_waiting_for_blocks_releases_its_pins(plain) -> None:
    out, _ = plain
    waiting = out["waiting"]
    # W counted P's 768 cached tokens (3 chunks, pinned under its request id) but
    # vLLM has 7 free blocks of the 8 it needs: it waits, not loaded.
    assert waiting["waiting"] == 1 and waiting["free_blocks"] < 8
    (held,) = [n for rid, n in waiting["pinned_keys"].items() if rid.startswith("W-")]
    assert held == 3 and waiting["l1_pins"] == 3
    assert not [c for c in waiting["calls"] if c[0] == "retrieve"]
    aborted = out["waiting_aborted"]
    assert aborted["pinned_keys"] == {} and aborted["l1_pins"] == 0
    assert aborted["waited_s"] < 1  # the release is a message; it arrives at once
    assert out["after_waiting"]["hit"] == 768
    assert out["after_waiting"]["tokens"] == out["ref_p"]["tokens"]
    no_pins_left(out["after_waiting_state"])


def test_abort_mid_prefill_keeps_what_was_saved_and_nothing_pinned(plain) -> None:
    out, _ = plain
    calls = out["mid_prefill"]["calls"]
    loads = [c for c in calls if c[0] == "retrieve"]
    assert [c[1].split("-")[0] for c in loads] == ["Q"] and loads[0][4] == 768
    # two steps of 512 tokens from 768 on: chunks up to token 1792 stored
    assert [(c[2], c[3]) for c in calls if c[0] == "store"] == [(768, 1280), (1280, 1792)]
    assert out["mid_prefill"]["connector_requests"] == 1
    no_pins_left(out["mid_prefill_aborted"])
    again = out["q_again"]
    assert again["hit"] == 1792
    assert again["tokens"] == out["ref_q"]["tokens"]
    no_pins_left(out["q_again_state"])


def test_preempted_request_loads_once_and_stores_each_chunk_once(plain) -> None:
    out, _ = plain
    assert out["preemptions"] >= 1
    for got, ref in zip(out["r"], out["ref_r"], strict=True):
        assert got["tokens"] == ref["tokens"]
    calls = out["r_state"]["calls"]
    loads = [c for c in calls if c[0] == "retrieve"]
    # The prompts were new: only a resumption finds anything, its own 512 tokens,
    # loaded once per resumption (vLLM recomputes the rest, outputs included).
    assert len(loads) == out["preemptions"]
    assert all(c[3] == 512 and c[4] == 512 for c in loads)
    stores = [(c[2], c[3]) for c in calls if c[0] == "store"]
    assert sum(end - skip for skip, end in stores) == 3 * 512
    no_pins_left(out["r_state"])
    # what was stored is right: served from kvmesh, the same greedy outputs
    for got, ref in zip(out["r_again"], out["ref_r"], strict=True):
        assert got["hit"] == 512 and got["tokens"] == ref["tokens"]
    no_pins_left(out["r_again_state"])


def test_failed_lookups_are_misses_and_the_engine_recovers(plain) -> None:
    out, _ = plain
    ref = out["ref_p"]["tokens"]
    for case in ("loop_busy", "storage_broken", "no_server"):
        assert out[case]["hit"] == 0, case
        assert out[case]["tokens"] == ref, case
        assert out[case]["seconds"] < 5, case  # lookup_timeout_s is 0.5
    for case in ("loop_busy_after", "storage_back", "server_back"):
        assert out[case]["hit"] == 768, case
        assert out[case]["tokens"] == ref, case
    no_pins_left(out["end_state"])


def test_a_load_that_cannot_be_planned_is_recomputed_not_read(plain) -> None:
    out, log = plain
    # vLLM counted 768 tokens as loaded; their blocks hold other prompts' KV. They are
    # reported failed and recomputed (before, they were read as they were).
    assert "kvmesh could not plan" in log
    recovered = re.findall(r"Recovered from KV load failure: .*", log)
    assert recovered == [
        "Recovered from KV load failure: 1 request(s) rescheduled (768 tokens affected)."
    ]
    assert out["unplanned"]["tokens"] == out["ref_p8"]["tokens"]
    assert out["after_unplanned"]["hit"] == 768
    assert out["after_unplanned"]["tokens"] == out["ref_p8"]["tokens"]


def test_vllm_cache_salt_keeps_kvmesh_chunks_apart(prefix) -> None:
    out, _ = prefix
    assert out["p_b_first"]["saved"] == 768  # stored under salt b...
    assert out["p_a"]["hit"] == 0 and out["p_a"]["cached"] == 0  # ...not found under a
    assert out["p_a"]["saved"] == 768  # and stored again, under a
    for case in ("p_b_first", "p_a"):
        assert out[case]["tokens"] == out["ref_p"]["tokens"]


def test_vllm_prefix_hit_then_kvmesh_loads_the_rest(prefix) -> None:
    out, _ = prefix
    p_b = out["p_b"]
    # vLLM had P's first 384 tokens (3 blocks of X); kvmesh counts the next 384 and
    # loads from the chunk boundary at 256 (its chunk 1 is rewritten whole).
    assert p_b["hit"] == 384 and p_b["cached"] == 768
    (load,) = [c for c in out["p_b_state"]["calls"] if c[0] == "retrieve"]
    assert load[2:] == [256, 768, 512]
    assert p_b["tokens"] == out["ref_p"]["tokens"]
    no_pins_left(out["p_b_state"])


def test_failed_load_across_vllm_hit_rolls_back_only_its_request(prefix) -> None:
    out, log = prefix
    (load,) = [c for c in out["p_c_state"]["calls"] if c[0] == "retrieve"]
    assert load[2:] == [256, 768, 0]  # nothing loaded: both chunks were gone
    # Only Pc recomputes, from vLLM's hit at 384 to 768; Y, running on the blocks
    # vLLM shares with Pc below 384, is not rolled back (it was, with 746 tokens,
    # when kvmesh reported those blocks too).
    recovered = re.findall(r"Recovered from KV load failure: .*", log)
    assert recovered == [
        "Recovered from KV load failure: 1 request(s) rescheduled (384 tokens affected)."
    ]
    assert out["y_c"]["tokens"] == out["ref_y"]["tokens"]
    assert out["p_c"]["tokens"] == out["ref_p"]["tokens"]
    no_pins_left(out["p_c_state"])


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_child(json.loads(Path(sys.argv[1]).read_text()))))
