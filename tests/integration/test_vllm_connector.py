"""kvmesh as the KV connector of a real vLLM on CPU (tiny random Llama, vLLM's prefix
cache off, so every reused token comes from kvmesh).

One vLLM process per loading mode serves the scenario below in order; each check
reads its step's result. Outputs must equal plain vLLM's exactly (first-token
logprobs compared as floats, no tolerance).
"""

from __future__ import annotations

import pytest
from vllm_fixture import PROMPTS, Step, connector_config, run_session

from kvmesh.services.worker.vllm.testing import SessionError
from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

# A vLLM start-up is 15-30 s on 2 cores; a module fixture starts two, plus the reference.
pytestmark = pytest.mark.timeout(900)

P, P600 = PROMPTS["p1000"], PROMPTS["p600"]
T, S, M = (prompt_tokens(1000, seed=s) for s in (3, 4, 5))


def kv(**options: object) -> dict:
    return {"kvmesh": options}


SCENARIO = {
    "cold": Step(P),
    "warm": Step(P),
    "p600": Step(P600),
    # the last of the 3 cached chunks vanishes between lookup and load
    "drop_last": Step(P, drop="last"),
    # the 2 chunks left vanish too
    "drop_all": Step(P, drop="all"),
    "tenant_a_first": Step(T, kv_transfer_params=kv(tenant="a")),
    "tenant_b": Step(T, kv_transfer_params=kv(tenant="b")),
    "no_tenant": Step(T),
    "tenant_a_again": Step(T, kv_transfer_params=kv(tenant="a")),
    "skip_save": Step(S, kv_transfer_params=kv(skip_save=True)),
    "after_skip_save": Step(S),
    "skip_load": Step(S, kv_transfer_params=kv(skip_load=True)),
    "malformed": Step(M, kv_transfer_params=kv(tenat="a")),
    "after_malformed": Step(M),
}


@pytest.fixture(scope="module", params=["whole", "layerwise"])
def session(request: pytest.FixtureRequest, tiny_model):
    result = run_session(
        tiny_model,
        list(SCENARIO.values()),
        connector=connector_config(layerwise=request.param == "layerwise"),
        llm_kwargs={"kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}},
    )
    steps = dict(zip(SCENARIO, result.steps, strict=True))
    return result, steps


def test_first_request_is_a_miss_and_matches_plain_vllm(session, reference) -> None:
    _, steps = session
    cold = steps["cold"]
    assert cold.hit_tokens == 0 and cold.num_cached_tokens == 0
    assert cold.kvmesh == {"hit_tokens": 0, "saved_tokens": 768}
    assert cold.logprobs[0] == reference.cold("p1000").logprobs[0]


def test_same_prompt_again_loads_768_tokens_with_exact_logprobs(session, reference) -> None:
    _, steps = session
    warm = steps["warm"]
    assert warm.hit_tokens >= 768
    assert warm.num_cached_tokens >= 768  # vLLM's own count of tokens it did not compute
    ref = reference.split("p1000", 768)
    assert warm.logprobs[0] == ref.logprobs[0]
    assert warm.output_tokens == ref.output_tokens
    # and within float noise of a cold run (vLLM itself moves ~1e-6 with the split)
    cold = reference.cold("p1000")
    assert warm.output_tokens == cold.output_tokens
    assert warm.logprobs[0].keys() == cold.logprobs[0].keys()
    assert all(abs(warm.logprobs[0][t] - lp) < 1e-4 for t, lp in cold.logprobs[0].items())


def test_prompt_sharing_600_tokens_reuses_512(session, reference) -> None:
    _, steps = session
    assert steps["p600"].hit_tokens == 512
    assert steps["p600"].num_cached_tokens == 512
    assert steps["p600"].logprobs[0] == reference.split("p600", 512).logprobs[0]


def test_failed_load_is_recomputed_with_exact_output(session, reference) -> None:
    result, steps = session
    # The scheduler counted 768 (resp. 512) tokens, the load came up short, vLLM
    # recomputed the blocks from the first missing token on: from token 512 (the two
    # chunks that did load), then from 0.
    assert steps["drop_last"].hit_tokens == 768
    assert steps["drop_last"].logprobs[0] == reference.split("p1000", 512).logprobs[0]
    assert steps["drop_all"].hit_tokens == 512  # the dropped chunk was not stored again
    assert steps["drop_all"].logprobs[0] == reference.cold("p1000").logprobs[0]
    assert "kvmesh loaded 512 of 768 tokens" in result.log
    assert "kvmesh loaded 0 of 512 tokens" in result.log
    assert result.log.count("Recovered from KV load failure") == 2


def test_tenants_do_not_share_chunks(session) -> None:
    _, steps = session
    assert steps["tenant_a_first"].hit_tokens == 0
    assert steps["tenant_b"].hit_tokens == 0
    assert steps["no_tenant"].hit_tokens == 0
    assert steps["tenant_a_again"].hit_tokens == 768
    # tenant a's chunks came back (a warm request: within float noise of the cold one,
    # see vllm_fixture.Reference; exactness of loads is checked on p1000)
    again, first = steps["tenant_a_again"], steps["tenant_a_first"]
    assert again.output_tokens == first.output_tokens
    assert all(abs(again.logprobs[0][t] - lp) < 1e-4 for t, lp in first.logprobs[0].items())


def test_skip_save_and_skip_load(session) -> None:
    _, steps = session
    assert steps["skip_save"].kvmesh == {"hit_tokens": 0, "saved_tokens": 0}
    assert steps["after_skip_save"].hit_tokens == 0  # nothing was stored
    assert steps["skip_load"].hit_tokens == 0  # though after_skip_save stored it
    assert steps["skip_load"].num_cached_tokens == 0


def test_malformed_params_serve_without_the_cache(session) -> None:
    result, steps = session
    assert steps["malformed"].kvmesh == {"hit_tokens": 0, "saved_tokens": 0}
    assert steps["after_malformed"].hit_tokens == 0
    assert "served without kvmesh" in result.log and "tenat" in result.log


def test_engine_counters(session) -> None:
    result, _ = session
    engine = result.engine
    # Each request stores the whole chunks the cache lacked: P 768; P600 its third
    # chunk (256); T once per namespace (tenant a, tenant b, none: 3 x 768); S and M
    # only when asked normally (768 each). drop_all none: its load failed, so the chunk
    # its step computed (the one drop_last removed) rests on unloaded blocks, and
    # storing it would serve wrong KV to the next request for P.
    assert engine["tokens_stored"] == 768 + 256 + 3 * 768 + 768 + 768
    assert "a load it rests on failed" in result.log  # the save skipped (whole) or dropped
    assert engine["lookup_server_requests"] >= len(SCENARIO) - 2  # skip_load, malformed


def test_kv_events_reach_the_scheduler(session) -> None:
    result, _ = session
    # one BlockStored per chunk stored (see test_engine_counters) but tenant a's and
    # b's (2 x 3: a tenant's chunks are never published), one BlockRemoved per chunk
    # the drop steps removed (1 + 2)
    assert result.events.get("BlockStored") == result.engine["tokens_stored"] // 256 - 6
    assert result.events.get("BlockRemoved") == 3


def test_a_then_b_l1_does_not_outlive_its_process(serve_a_then_b, reference) -> None:
    """The fixture later tiers extend: B is a fresh process, so with L1 only it finds
    nothing, and both answer exactly like plain vLLM."""
    a, b = serve_a_then_b([Step(P), Step(P)], connector_config())
    assert [s.hit_tokens for s in a.steps] == [0, 768]
    assert [s.hit_tokens for s in b.steps] == [0, 768]
    for run in (a, b):
        assert run.steps[0].logprobs[0] == reference.cold("p1000").logprobs[0]
        assert run.steps[1].logprobs[0] == reference.split("p1000", 768).logprobs[0]


def test_bad_config_stops_vllm_naming_the_key(tiny_model) -> None:
    with pytest.raises(SessionError) as info:
        run_session(
            tiny_model,
            [Step(P)],
            connector={"config": {"engine": {"chunk_sise": 128}}},
        )
    assert "engine.chunk_sise: unknown key; did you mean engine.chunk_size?" in str(info.value)
