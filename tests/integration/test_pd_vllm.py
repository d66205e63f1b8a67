"""Disaggregated prefill end to end: two real vLLM servers on CPU (the tiny model; a
kv_producer prefiller and a kv_consumer decoder, both through the kvmesh connector) and
the bridge in front of them.

- A completion through the bridge equals plain vLLM's, token for token and first-token
  logprob for logprob, and the decoder loaded the prompt's KV instead of computing it.
- A decoder out of room refuses the chunks it cannot hold: the rest is recomputed, the
  answer is still plain vLLM's, nothing hangs.
- A prefiller killed mid-transfer: the request still completes (the decoder computes
  what never arrived) and the decoder frees every receive buffer.

The prefiller computes 256 tokens per step (--max-num-batched-tokens 256), so a prompt
is pushed in several transfers, one per step, and a kill can land between them. The
reference is plain vLLM prefilling in the same 256-token steps (vLLM on CPU is not
invariant to how a prefill is split; see vllm_fixture.Reference).
"""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvtest.bridge import BridgeProcess, parse_metrics
from kvtest.vllm_server import VllmServer, free_port, kvmesh_transfer_config
from kvtest.waiting import wait_for
from vllm_fixture import Step, run_session

from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

pytestmark = pytest.mark.timeout(900)

STEP_TOKENS = 256
P1025 = prompt_tokens(1025, seed=11)  # 4 chunks and a 1-token one
P4000 = prompt_tokens(4000, seed=12)  # 16 chunks: more than the decoder's 12 pages
P2560 = prompt_tokens(2560, seed=13)  # 10 chunks, pushed in 10 steps
DECODER_PAGES = 12  # L1 of 3 MiB, 256 KiB chunks (2 layers x 2 x 64 x float32 x 256)


@dataclass
class Mesh:
    model: str
    prefiller: VllmServer
    decoder: VllmServer
    bridge: BridgeProcess
    decoder_metrics: str
    prefiller_metrics: str
    reference: dict[str, object]

    def engine(self, which: str) -> dict[str, float]:
        url = self.decoder_metrics if which == "decoder" else self.prefiller_metrics
        with urllib.request.urlopen(url, timeout=5) as resp:
            return parse_metrics(resp.read().decode())

    def complete(self, prompt: list[int], max_tokens: int, **extra: object) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            **extra,
        }
        status, answer = self.bridge.post("/v1/completions", body, timeout_s=120)
        assert status == 200, answer
        return answer


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    for key, value in values.items():
        if key.split("{")[0] == f"kvmesh_{name}" and all(
            f'{k}="{v}"' in key for k, v in labels.items()
        ):
            return value
    return 0.0


def _reference(model: Path, workdir: Path) -> dict[str, object]:
    """Plain vLLM, prefilling in the prefiller's steps, prefix cache on: each split
    case serves a prompt with the same first h tokens first (a cache salt per case)."""
    filler1025 = P1025[:1024] + prompt_tokens(1, seed=98)
    filler4000 = P4000[: DECODER_PAGES * 256] + prompt_tokens(4000 - DECODER_PAGES * 256, seed=99)
    steps = [
        Step(filler1025, cache_salt="a"),
        Step(P1025, cache_salt="a", max_tokens=8),
        Step(filler4000, cache_salt="b"),
        Step(P4000, cache_salt="b", max_tokens=4),
        Step(P2560, cache_salt="c", max_tokens=4),
    ]
    result = run_session(
        model,
        steps,
        llm_kwargs={"enable_prefix_caching": True, "max_num_batched_tokens": STEP_TOKENS},
        workdir=workdir / "reference",
    )
    split1025, split4000, cold2560 = result.steps[1], result.steps[3], result.steps[4]
    assert split1025.num_cached_tokens == 1024
    assert split4000.num_cached_tokens == DECODER_PAGES * 256
    return {"p1025": split1025, "p4000": split4000, "p2560": cold2560}


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("pd")
    p2p_port, dec_metrics, pre_metrics = free_port(), free_port(), free_port()

    def engine(**kw: object) -> dict:
        return {"engine": {"chunk_size": 256, **kw}}

    prefiller = VllmServer(
        tiny_model,
        work,
        name="prefiller",
        kv_transfer_config=kvmesh_transfer_config(
            "kv_producer",
            engine(
                l1={"max_size": "64MiB", "reserve": 0},
                pd={"role": "sender", "timeout_s": 10},
                metrics_port=pre_metrics,
            ),
            instance_id="prefiller",
        ),
        args=["--max-num-batched-tokens", str(STEP_TOKENS)],
    )
    decoder = VllmServer(
        tiny_model,
        work,
        name="decoder",
        kv_transfer_config=kvmesh_transfer_config(
            "kv_consumer",
            engine(
                l1={"max_size": "3MiB", "reserve": 0},
                pd={"role": "receiver", "timeout_s": 2, "max_receive_fraction": 1.0, "hold_s": 20},
                p2p={"port": p2p_port},
                metrics_port=dec_metrics,
            ),
            instance_id="decoder",
            lookup_timeout_s=5,
        ),
        # vLLM's own prefix cache off: every reused token must come from kvmesh.
        args=["--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
    )
    meanwhile = lambda: _reference(tiny_model, work)  # noqa: E731
    with _bridged(work, prefiller, decoder, p2p_port, meanwhile) as (bridge, reference):
        yield Mesh(
            str(tiny_model),
            prefiller,
            decoder,
            bridge,
            f"http://127.0.0.1:{dec_metrics}/metrics",
            f"http://127.0.0.1:{pre_metrics}/metrics",
            reference,
        )


@contextlib.contextmanager
def _bridged(
    work: Path,
    prefiller: VllmServer,
    decoder: VllmServer,
    p2p_port: int,
    meanwhile: Callable[[], object] = lambda: None,
) -> Iterator[tuple[BridgeProcess, object]]:
    """Both servers started (meanwhile() run while they start), then a bridge over
    them; the bridge and what meanwhile() returned. All stopped on exit."""
    prefiller.launch()
    decoder.launch()
    try:
        result = meanwhile()
        prefiller.wait_ready()
        decoder.wait_ready()
        bridge = BridgeProcess(
            work,
            prefillers=[prefiller.url],
            decoders=[(decoder.url, [f"tcp://127.0.0.1:{p2p_port}"])],
            prefill_timeout_s=30,
        )
        bridge.launch()
        bridge.wait_ready()
        try:
            yield bridge, result
        finally:
            bridge.stop()
    finally:
        prefiller.stop()
        decoder.stop()


def _tokens(answer: dict) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def _first_logprob(answer: dict) -> float:
    return answer["choices"][0]["logprobs"]["token_logprobs"][0]


def _why(mesh: Mesh) -> str:
    """What the bridge and both engines counted: the story of a transfer that failed."""
    seen = {**mesh.bridge.metrics(), **mesh.engine("prefiller"), **mesh.engine("decoder")}
    words = (
        "fallbacks_total", "pd_receive", "pd_received", "pd_rejected", "pd_transfers",
        "pd_pushes", "tokens_hit", "requests_total{",
    )  # fmt: skip
    return "\n".join(
        f"{k} {v}" for k, v in seen.items() if any(w in k for w in words) and "created" not in k
    )


def _fallbacks(mesh: Mesh) -> float:
    return _fallbacks_of(mesh.bridge)


def test_first_request_of_a_bfloat16_decoder_loads_its_whole_prompt_and_answers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A decoder whose very first step is a PD decode: every prompt token but the last
    loaded, one computed. In bfloat16 (vLLM's default for this float32 model, as in
    compose.yaml) vLLM's CPU attention then runs AMX tile instructions before anything
    in the process asked Linux for them; without the connector's request (cpu_amx) the
    engine core died of SIGILL on a CPU with AMX: a 500, and a dead decoder. Its own
    servers: the decoder must not have served anything before (before `mesh` starts)."""
    work = tmp_path_factory.mktemp("bf16")  # short: vLLM's IPC sockets live under it
    p2p_port, dec_metrics = free_port(), free_port()
    prefiller = VllmServer(
        tiny_model,
        work,
        name="pre16",
        dtype="bfloat16",
        kv_transfer_config=kvmesh_transfer_config(
            "kv_producer",
            {"engine": {"l1": {"max_size": "64MiB", "reserve": 0}, "pd": {"role": "sender"}}},
            instance_id="prefiller-bf16",
        ),
        args=["--no-enable-prefix-caching"],
    )
    decoder = VllmServer(
        tiny_model,
        work,
        name="dec16",
        dtype="bfloat16",
        kv_transfer_config=kvmesh_transfer_config(
            "kv_consumer",
            {
                "engine": {
                    "l1": {"max_size": "64MiB", "reserve": 0},
                    "pd": {"role": "receiver"},
                    "p2p": {"port": p2p_port},
                    "metrics_port": dec_metrics,
                }
            },
            instance_id="decoder-bf16",
        ),
        args=["--no-enable-prefix-caching"],
    )
    with _bridged(work, prefiller, decoder, p2p_port) as (bridge, _):
        prompt = prompt_tokens(1500, seed=1)  # 5 chunks and a partial one
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        for attempt in range(2):
            status, answer = bridge.post("/v1/completions", body, timeout_s=120)
            assert status == 200, (attempt, answer, decoder.log_tail())
            assert answer["choices"][0]["text"], answer
            # Loaded, not computed: every prompt token but the last came from kvmesh.
            hit = answer["kv_transfer_params"]["kvmesh_result"]["hit_tokens"]
            assert hit == len(prompt) - 1, (attempt, answer)
        assert decoder.proc.poll() is None
        with urllib.request.urlopen(f"{decoder.url}/health", timeout=5) as resp:
            assert resp.status == 200
        assert _fallbacks_of(bridge) == 0


def _fallbacks_of(bridge: BridgeProcess) -> float:
    values = bridge.metrics()
    return sum(v for k, v in values.items() if k.startswith("kvmesh_bridge_fallbacks_total{"))


def test_completion_through_the_bridge_equals_plain_vllm_and_the_decoder_loads_the_kv(
    mesh: Mesh,
) -> None:
    before = mesh.engine("decoder")
    answer = mesh.complete(P1025, 8)
    ref = mesh.reference["p1025"]
    assert _tokens(answer) == ref.output_tokens
    assert _first_logprob(answer) == ref.logprobs[0][ref.output_tokens[0]]
    # The decoder loaded every prompt token but the last from kvmesh (vLLM computes the
    # last one itself), and vLLM counted them as not computed.
    assert answer["kv_transfer_params"]["kvmesh_result"]["hit_tokens"] == 1024, _why(mesh)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
    after = mesh.engine("decoder")
    assert (
        metric(after, "pd_received_chunks_total") - metric(before, "pd_received_chunks_total") == 5
    )
    hit = metric(after, "tokens_hit_total", tier="l1") - metric(
        before, "tokens_hit_total", tier="l1"
    )
    assert hit == 1024  # whole chunks up to what vLLM counts as loaded
    # Five prefill steps: five pushes, each committed.
    assert metric(mesh.engine("prefiller"), "pd_pushes_total", outcome="ok") >= 5
    # Once the decode is over, what was received is released and dropped.
    wait_for(lambda: metric(mesh.engine("decoder"), "pd_transfers_held") == 0, 5)
    assert metric(mesh.engine("decoder"), "pd_receive_pages") == 0


def test_streaming_through_the_bridge_gives_the_same_tokens(mesh: Mesh) -> None:
    body = {
        "model": mesh.model,
        "prompt": P1025,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    events = mesh.bridge.stream("/v1/completions", body, timeout_s=120)
    tokens = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert tokens == mesh.reference["p1025"].output_tokens
    assert _fallbacks(mesh) == 0


def test_decoder_out_of_room_refuses_and_the_rest_is_recomputed(mesh: Mesh) -> None:
    wait_for(lambda: metric(mesh.engine("decoder"), "l1_usage_bytes") == 0, 10)
    before_pre = mesh.engine("prefiller")
    answer = mesh.complete(P4000, 4)
    ref = mesh.reference["p4000"]
    # The decoder held what fit (12 chunks, pinned until the decode) and refused the
    # rest; it computed those 928 tokens itself, and the answer is plain vLLM's.
    hit = answer["kv_transfer_params"]["kvmesh_result"]["hit_tokens"]
    assert hit == DECODER_PAGES * 256, _why(mesh)
    assert _tokens(answer) == ref.output_tokens
    assert _first_logprob(answer) == ref.logprobs[0][ref.output_tokens[0]]
    after_pre = mesh.engine("prefiller")
    refused = metric(after_pre, "pd_pushes_total", outcome="refused") - metric(
        before_pre, "pd_pushes_total", outcome="refused"
    )
    assert refused >= 1
    dec = mesh.engine("decoder")
    assert metric(dec, "pd_receive_allocs_total", outcome="refused") >= 1
    wait_for(lambda: metric(mesh.engine("decoder"), "pd_receive_pages") == 0, 5)


def test_prefiller_killed_mid_transfer_still_answers_and_leaks_no_buffer(mesh: Mesh) -> None:
    """Last: it kills the prefiller."""
    import threading

    before = metric(mesh.engine("decoder"), "pd_received_chunks_total")
    result: dict[str, object] = {}

    def ask() -> None:
        result["answer"] = mesh.complete(P2560, 4)

    client = threading.Thread(target=ask)
    client.start()
    # Kill once a few of the prompt's 10 chunks have landed: mid-transfer.
    wait_for(
        lambda: metric(mesh.engine("decoder"), "pd_received_chunks_total") - before >= 2,
        60,
        "two chunks landed on the decoder",
    )
    os.killpg(mesh.prefiller.proc.pid, signal.SIGKILL)
    at_kill = metric(mesh.engine("decoder"), "pd_received_chunks_total") - before
    client.join(120)
    assert not client.is_alive()
    assert at_kill < 10, "the kill came after the whole prompt had landed"
    answer = result["answer"]
    assert _tokens(answer) == mesh.reference["p2560"].output_tokens
    # Nothing leaks on the decoder: in-flight buffers go at their deadline, what was
    # committed after pd.hold_s (the decode never names the dead transfer).
    dec = lambda: mesh.engine("decoder")  # noqa: E731
    wait_for(lambda: metric(dec(), "pd_receive_inflight") == 0, 20)
    wait_for(lambda: metric(dec(), "pd_receive_pages") == 0, 1)
    wait_for(lambda: metric(dec(), "pd_transfers_held") == 0, 30)
    wait_for(lambda: metric(dec(), "l1_usage_bytes") == 0, 5)
    assert _fallbacks(mesh) >= 1
