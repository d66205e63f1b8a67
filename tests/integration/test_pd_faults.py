"""Disaggregated prefill between engine processes while one of them fails.

A prefiller and a decoder (kvtest.pd_node, each its own process, over the NIXL and the
ZMQ channel) push prompts' KV layer by layer, slowly enough (a pause between layers,
the model computing the next) that a test can SIGKILL or SIGSTOP either side in the
middle of a push. Whatever happens the decoder never serves KV the prefiller did not
compute (every loaded token is checked bit for bit), a push gives up by its deadline,
neither side keeps a page or a pin for a push that failed (the counters say so), and
both serve the next push.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from kvtest.pd_node import PROMPT
from kvtest.service_process import KvtestProcess, free_port
from kvtest.waiting import wait_for

from kvmesh.common.chunk_codec import payload_checksum
from kvmesh.common.protocol import p2p as proto

CHUNKS = 5  # PROMPT: four full chunks and a partial one
PUSH_S = 2.0  # the prefiller's push deadline (pd.timeout_s)
GRACE_S = 1.0  # the decoder's pd.timeout_s: a dead push's buffers go after PUSH_S + this
DELAY_S = 0.4  # between layers: a push of 4 layers takes 1.2 s
SWEEP_S = 1.0  # the engine's expiry pass runs at least this often
CHANNELS = ["zmq", "nixl"]
# What a bound may be overrun by on a loaded 2-core machine (processes descheduled);
# still short of a second deadline.
SLACK_S = 1.5


class PdNode(KvtestProcess):
    def __init__(self, tmp: Path, name: str, **cfg: object) -> None:
        self.cfg = {"name": name, **cfg}
        super().__init__(
            f"pd node {name}", "pd_node", [json.dumps(self.cfg)],
            log=tmp / f"{name}.log", ready_line="{",
        )  # fmt: skip
        self.info: dict = {}

    def up(self) -> PdNode:
        self.launch()
        self.info = self.wait_ready(60)
        return self

    @property
    def endpoint(self) -> str:
        return self.info["endpoint"]

    def state(self) -> dict:
        return self(op="state")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., PdNode]]:
    started: list[PdNode] = []

    def start(name: str, role: str, channel: str, **cfg: object) -> PdNode:
        cfg.setdefault("timeout_s", PUSH_S if role == "sender" else GRACE_S)
        node = PdNode(tmp_path, name, role=role, channel=channel, **cfg)
        started.append(node)
        return node.up()

    yield start
    for node in started:
        node.stop()


def push(p: PdNode, d: PdNode, seed: int, tid: str, delay_s: float = 0.0) -> None:
    p(op="push", seed=seed, transfer_id=tid, endpoint=d.endpoint, delay_s=delay_s)


def assert_clean(d: PdNode) -> dict:
    """Nothing of any push left on the decoder: no allocation, no page, no hold."""
    s = d.state()
    assert s["inflight"] == 0 and s["pages"] == 0 and s["held"] == 0, s
    assert s["used_pages"] == 0 and s["l1_chunks"] == 0, s
    assert s["free_pages"] == s["free_at_start"], s
    return s


def assert_push_works(p: PdNode, d: PdNode, seed: int, tid: str) -> None:
    """A push lands whole and loads bit for bit; its hold ends with the load."""
    push(p, d, seed, tid)
    done = p(op="pushed")
    assert done["running"] is False and done["pushed"] == PROMPT, done
    got = d(op="load", seed=seed, transfer_id=tid)
    assert got == {"lookup": PROMPT, "loaded": PROMPT, "wrong": []}, got
    wait_for(lambda: d.state()["used_pages"] == 0, 3, "the loaded transfer dropped")


def started_pushing(d: PdNode) -> None:
    """The decoder has allocated the push's buffers (a layer or more is on its way)."""
    wait_for(lambda: d.state()["inflight"] == 1, 10, "an allocation on the decoder")


@pytest.mark.parametrize("channel", CHANNELS)
def test_prefiller_killed_mid_push_frees_the_decoder_s_buffers(nodes, channel: str) -> None:
    p = nodes("pre", "sender", channel)
    d = nodes("dec", "receiver", channel)
    push(p, d, 1, "t-kill", DELAY_S)
    started_pushing(d)
    time.sleep(DELAY_S)  # a layer or two written
    assert d.state()["pages"] == CHUNKS
    p.kill()
    t0 = time.monotonic()
    # The buffers go back by the push's deadline plus the grace (and one expiry pass).
    wait_for(lambda: d.state()["inflight"] == 0, PUSH_S + GRACE_S + SWEEP_S + 2, "expiry")
    freed_s = time.monotonic() - t0
    assert freed_s <= PUSH_S + GRACE_S + SWEEP_S + SLACK_S, freed_s
    s = assert_clean(d)
    assert s["expired"] == 1 and s["received"] == 0, s
    # Nothing of the half-pushed prompt is served.
    assert d(op="load", seed=1) == {"lookup": 0, "loaded": 0, "wrong": []}
    # The decoder serves the next prefiller, the same prompt included.
    p2 = nodes("pre2", "sender", channel)
    assert_push_works(p2, d, 1, "t-after")
    assert_clean(d)


@pytest.mark.parametrize("channel", CHANNELS)
def test_prefiller_frozen_past_its_deadline_gives_up_and_writes_nothing_late(
    nodes, channel: str
) -> None:
    p = nodes("pre", "sender", channel)
    d = nodes("dec", "receiver", channel)
    other = nodes("other", "sender", channel)
    push(p, d, 1, "t-frozen", DELAY_S)
    started_pushing(d)
    time.sleep(DELAY_S)
    frozen = threading.Thread(target=p.freeze, args=(PUSH_S + GRACE_S + SWEEP_S + 2,))
    frozen.start()
    try:
        # While it is stopped its buffers expire, and another push takes the pages.
        wait_for(lambda: d.state()["expired"] == 1, PUSH_S + GRACE_S + SWEEP_S + 2, "expiry")
        push(other, d, 2, "t-other")
        assert other(op="pushed")["pushed"] == PROMPT
    finally:
        frozen.join()
    # Woken past its deadline: it gives up, cancels, and writes nothing more.
    done = p(op="pushed", timeout_s=PUSH_S + 5)
    assert done["running"] is False and done["pushed"] == 0, done
    s = p.state()
    assert s["pushes"] == {"ok": 0, "refused": 0, "failed": 1} and s["push_inflight"] == 0, s
    # The chunks it still holds are its own prompt's, cached as any saved prompt.
    assert s["used_pages"] == s["l1_chunks"] == CHUNKS, s
    time.sleep(0.5)  # anything late would have landed by now
    got = d(op="load", seed=2, transfer_id="t-other")
    assert got == {"lookup": PROMPT, "loaded": PROMPT, "wrong": []}, got
    assert d(op="load", seed=1) == {"lookup": 0, "loaded": 0, "wrong": []}
    wait_for(lambda: d.state()["used_pages"] == 0, 3, "the loaded transfer dropped")
    assert_clean(d)
    assert_push_works(p, d, 3, "t-next")


@pytest.mark.parametrize("channel", CHANNELS)
def test_decoder_killed_mid_push_fails_the_push_by_its_deadline(nodes, channel: str) -> None:
    port = free_port()
    p = nodes("pre", "sender", channel)
    d = nodes("dec", "receiver", channel, port=port)
    push(p, d, 1, "t-kill", DELAY_S)
    started_pushing(d)
    d.kill()
    done = p(op="pushed", timeout_s=PUSH_S + 5)
    assert done["running"] is False and done["pushed"] == 0, done
    # Within the deadline (the layers' pauses run beside it), plus the cancel's second.
    assert done["seconds"] <= PUSH_S + 1.0 + SLACK_S, done
    s = p.state()
    assert s["pushes"]["failed"] == 1 and s["push_inflight"] == 0, s
    assert s["used_pages"] == s["l1_chunks"] == CHUNKS, s  # its own cache, nothing else
    # The decoder comes back behind the same endpoint (a restarted pod): every push to
    # it works again, the first one included.
    d2 = nodes("dec2", "receiver", channel, port=port)
    assert d2.endpoint == d.endpoint
    for i in range(3):
        assert_push_works(p, d2, 10 + i, f"t-restart-{i}")
    assert p.state()["agents_retired"] == (1 if channel == "nixl" else 0)
    assert_clean(d2)


@pytest.mark.parametrize("channel", CHANNELS)
def test_decoder_frozen_mid_push_fails_the_push_and_holds_nothing_after(
    nodes, channel: str
) -> None:
    p = nodes("pre", "sender", channel)
    d = nodes("dec", "receiver", channel)
    push(p, d, 1, "t-frozen", DELAY_S)
    started_pushing(d)
    d.freeze(PUSH_S + 1.5)
    done = p(op="pushed", timeout_s=PUSH_S + 5)
    assert done["running"] is False and done["pushed"] == 0, done
    assert done["seconds"] <= PUSH_S + 1.0 + SLACK_S, done
    assert p.state()["push_inflight"] == 0
    # Awake, the decoder handles what was queued for it (late writes, a late commit,
    # the cancel): a push its sender gave up on leaves nothing held.
    wait_for(lambda: d.state()["inflight"] == 0, GRACE_S + SWEEP_S + 2, "the allocation ended")
    got = d(op="load", seed=1)
    assert got["wrong"] == [] and got["loaded"] in (0, PROMPT), got
    s = d.state()
    assert s["held"] == 0 and s["used_pages"] == 0, s
    assert_push_works(p, d, 2, "t-next")
    assert_clean(d)


def test_a_transfer_pushed_twice_is_held_once_and_dropped_once(nodes) -> None:
    """A prefill retried under the same transfer id (or a prompt pushed in two steps):
    the second push finds every chunk there, writes nothing, and shares the hold."""
    p = nodes("pre", "sender", "zmq")
    d = nodes("dec", "receiver", "zmq")
    for _ in range(2):
        push(p, d, 1, "t-dup")
        assert p(op="pushed")["pushed"] == PROMPT
    s = d.state()
    assert s["allocs_ok"] == 2 and s["received"] == CHUNKS, s  # the second wrote nothing
    assert s["held"] == 1 and s["used_pages"] == CHUNKS and s["pages"] == 0, s
    got = d(op="load", seed=1, transfer_id="t-dup")
    assert got == {"lookup": PROMPT, "loaded": PROMPT, "wrong": []}, got
    wait_for(lambda: d.state()["used_pages"] == 0, 3, "the transfer dropped")
    assert_clean(d)


@pytest.mark.parametrize(("channel", "then"), [("zmq", "zmq"), ("nixl", "nixl"), ("nixl", "zmq")])
def test_decoder_restarted_between_pushes_is_pushed_to_again(
    nodes, channel: str, then: str
) -> None:
    """Killed while idle, so no request to it failed: the prefiller's connection
    reconnects by itself, and what it knew of the old process (its NIXL agent) must
    not outlive it: the decoder's allocation names its agent (none when it comes back
    serving ZMQ only), so the prefiller hellos the new process before its first WRITE
    instead of failing it, and unloads the old agent."""
    port = free_port()
    p = nodes("pre", "sender", channel)
    d = nodes("dec", "receiver", channel, port=port)
    assert_push_works(p, d, 1, "t-before")
    d.kill()
    d2 = nodes("dec2", "receiver", then, port=port)
    outcomes = []
    for i in range(4):
        push(p, d2, 10 + i, f"t-after-{i}")
        pushed = p(op="pushed")["pushed"]
        outcomes.append(pushed)
        got = d2(op="load", seed=10 + i, transfer_id=f"t-after-{i}")
        assert got["wrong"] == [] and got["loaded"] == pushed, got
        wait_for(lambda: d2.state()["used_pages"] == 0, 3, "the transfer dropped")
    assert outcomes == [PROMPT] * 4, outcomes
    s = p.state()
    assert s["pushes"]["failed"] == 0, s
    assert s["agents_retired"] == (1 if channel == "nixl" else 0), s
    assert_clean(d2)


def test_bridge_killed_mid_prefill_leaves_nothing_held_and_serves_after_restart(
    nodes, tmp_path: Path
) -> None:
    """The bridge dies while the prefiller pushes: the push ends on its own, the decode
    that would end its hold never comes, and the decoder drops it after pd.hold_s. The
    restarted bridge (same port) serves PD requests again, loaded bit for bit."""
    from kvtest.bridge import BridgeProcess, request
    from kvtest.mesh_node import prompt_tokens

    hold_s = 3.0
    p = nodes("pre", "sender", "zmq", http=True, delay_s=DELAY_S)
    d = nodes("dec", "receiver", "zmq", http=True, hold_s=hold_s)
    bridge = BridgeProcess(
        tmp_path,
        prefillers=[f"http://127.0.0.1:{p.info['http_port']}"],
        decoders=[(f"http://127.0.0.1:{d.info['http_port']}", [d.endpoint])],
        prefill_timeout_s=10,
        decode_timeout_s=10,
    )
    bridge.start()
    try:

        def complete(seed: int) -> dict:
            body = {"prompt": prompt_tokens(seed, PROMPT), "max_tokens": 4}
            status, answer = bridge.post("/v1/completions", body)
            assert status == 200, answer
            return answer

        answer = complete(1)
        assert (answer["pd"], answer["loaded"], answer["wrong"]) == (True, PROMPT, []), answer
        wait_for(lambda: d.state()["used_pages"] == 0, 3, "the first transfer dropped")

        failed: list[BaseException] = []

        def killed_request() -> None:
            body = json.dumps({"prompt": prompt_tokens(2, PROMPT), "max_tokens": 4}).encode()
            try:
                request(bridge.url + "/v1/completions", body, timeout_s=30)
            except OSError as exc:  # the bridge is gone
                failed.append(exc)

        client = threading.Thread(target=killed_request)
        client.start()
        started_pushing(d)
        bridge.kill()
        client.join(30)
        assert not client.is_alive() and len(failed) == 1
        # The push goes on to the end: the decoder holds the transfer no decode names.
        wait_for(lambda: p.state()["pushes"]["ok"] == 2, PUSH_S + 2, "the orphan push ended")
        s = d.state()
        assert s["inflight"] == 0 and s["held"] == 1 and s["used_pages"] == CHUNKS, s
        # ... until pd.hold_s: then nothing of it is left.
        wait_for(lambda: d.state()["held"] == 0, hold_s + SWEEP_S + 2, "the hold dropped")
        assert_clean(d)
        bridge.start()
        for seed in (2, 3):
            answer = complete(seed)
            assert (answer["pd"], answer["loaded"], answer["wrong"]) == (True, PROMPT, [])
        wait_for(lambda: d.state()["used_pages"] == 0, 3, "the transfers dropped")
        assert_clean(d)
    finally:
        bridge.stop()


@pytest.mark.parametrize("channel", CHANNELS)
def test_prefiller_killed_with_chunks_the_decoder_had_leaves_no_pin(nodes, channel: str) -> None:
    """A push whose first chunks the decoder holds already (another transfer's) pins
    them at its allocation: its death must unpin them, or they never leave L1."""
    p = nodes("pre", "sender", channel)
    d = nodes("dec", "receiver", channel)
    push(p, d, 1, "t-first")
    assert p(op="pushed")["pushed"] == PROMPT
    # Seven chunks, the first four those of t-first.
    longer = 6 * 16 + 8
    p2 = nodes("pre2", "sender", channel)
    p2(op="push", seed=1, n=longer, transfer_id="t-dead", endpoint=d.endpoint, delay_s=DELAY_S)
    started_pushing(d)
    assert d.state()["pages"] == 3
    p2.kill()
    wait_for(lambda: d.state()["inflight"] == 0, PUSH_S + GRACE_S + SWEEP_S + 2, "expiry")
    assert d(op="load", seed=1, n=longer) == {"lookup": 4 * 16, "loaded": 4 * 16, "wrong": []}
    # t-first's decode ends: every chunk it held leaves L1, none kept by a stale pin.
    got = d(op="load", seed=1, transfer_id="t-first")
    assert got == {"lookup": PROMPT, "loaded": PROMPT, "wrong": []}, got
    wait_for(lambda: d.state()["used_pages"] == 0, 3, "t-first dropped")
    assert_clean(d)


def test_a_rogue_peer_writing_into_a_live_push_gets_it_rejected_not_served(nodes) -> None:
    """A peer that guesses an allocation id (they are counted) writes garbage into a
    push under way, and sends frames that do not fit: the frames are refused, the
    mixed chunks fail their checksums, nothing of them is served, and the decoder
    serves the next push."""
    # Slower than the others: the garbage must come before the push's last layer.
    p = nodes("pre", "sender", "zmq", timeout_s=3 * 1.0 + PUSH_S)
    d = nodes("dec", "receiver", "zmq")
    push(p, d, 1, "t-victim", 1.0)
    started_pushing(d)
    (alloc_id,) = d.state()["alloc_ids"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger, sock.rcvtimeo = 0, 3000
    sock.connect(d.endpoint)
    try:

        def ask(msg: proto.Request, *frames: bytes) -> proto.Reply:
            sock.send_multipart([proto.encode(msg), *frames])
            return proto.decode_reply(sock.recv_multipart()[:1])

        full, last = 64 << 10, 32 << 10  # a chunk's bytes, and the partial last one's
        v = proto.PROTOCOL_VERSION
        # Truncated: one frame short, and one byte short.
        bad = [
            (proto.PushChunks(1, v, alloc_id, -1, [0, 1]), [b"\xff" * full]),
            (proto.PushChunks(2, v, alloc_id, -1, [0]), [b"\xff" * (full - 1)]),
            (proto.PushChunks(3, v, alloc_id, 0, [4]), [b"\xff" * (last // 4 + 1)]),
        ]
        for msg, frames in bad:
            err = ask(msg, *frames)
            assert isinstance(err, proto.ErrorReply), err
            assert err.code == proto.ErrorCode.BAD_MESSAGE, err
            assert "frames" in err.message or "bytes" in err.message, err
        # Well-formed garbage over every chunk, every layer.
        garbage = [b"\xa5" * full] * 4 + [b"\xa5" * last]
        ok = ask(proto.PushChunks(4, v, alloc_id, -1, [0, 1, 2, 3, 4]), *garbage)
        assert ok == proto.PushChunksReply(4, 5)
    finally:
        sock.close(0)
        ctx.term()
    done = p(op="pushed", timeout_s=3 + PUSH_S + 5)
    assert done["running"] is False and done["pushed"] == 0, done
    s = d.state()
    assert s["received"] == 0 and s["rejected"] >= 1, s
    assert s["held"] == 0, s  # nothing kept, so nothing held until pd.hold_s
    assert d(op="load", seed=1) == {"lookup": 0, "loaded": 0, "wrong": []}
    wait_for(lambda: d.state()["inflight"] == 0, PUSH_S + GRACE_S + SWEEP_S + 2, "expiry")
    assert_clean(d)
    assert_push_works(p, d, 2, "t-next")


def test_prefiller_killed_under_the_bridge_falls_back_and_pd_resumes_after_restart(
    nodes, tmp_path: Path
) -> None:
    """The client's answer does not depend on the prefiller surviving: the decoder
    computes the prompt itself (nothing half-pushed is loaded), its buffers go back,
    and once the prefiller is back (same address) requests go through PD again."""
    from kvtest.bridge import BridgeProcess
    from kvtest.mesh_node import prompt_tokens

    http_port = free_port()
    p = nodes("pre", "sender", "zmq", http=True, http_port=http_port, delay_s=DELAY_S)
    d = nodes("dec", "receiver", "zmq", http=True)
    bridge = BridgeProcess(
        tmp_path,
        prefillers=[f"http://127.0.0.1:{http_port}"],
        decoders=[(f"http://127.0.0.1:{d.info['http_port']}", [d.endpoint])],
        prefill_timeout_s=10,
        decode_timeout_s=10,
        health_interval_s=0.2,
    )
    bridge.start()
    try:
        answers: list[dict] = []

        def complete(seed: int) -> None:
            body = {"prompt": prompt_tokens(seed, PROMPT), "max_tokens": 4}
            status, answer = bridge.post("/v1/completions", body)
            assert status == 200, answer
            answers.append(answer)

        client = threading.Thread(target=complete, args=(1,))
        client.start()
        started_pushing(d)
        p.kill()
        client.join(30)
        assert not client.is_alive() and len(answers) == 1
        assert (answers[0]["pd"], answers[0]["loaded"], answers[0]["wrong"]) == (False, 0, [])
        fallbacks = {k: v for k, v in bridge.metrics().items() if "fallbacks_total" in k and v}
        assert list(fallbacks.values()) == [1], fallbacks
        wait_for(lambda: d.state()["inflight"] == 0, PUSH_S + GRACE_S + SWEEP_S + 2, "expiry")
        assert d.state()["expired"] == 1
        assert_clean(d)
        nodes("pre2", "sender", "zmq", http=True, http_port=http_port)

        def prefiller_state() -> str:
            return json.loads(bridge.get("/health")[1])["prefillers"][0]["state"]

        wait_for(lambda: prefiller_state() == "up", 10, "the prefiller back up")
        complete(2)
        assert (answers[1]["pd"], answers[1]["loaded"], answers[1]["wrong"]) == (True, PROMPT, [])
        wait_for(lambda: d.state()["used_pages"] == 0, 3, "the transfer dropped")
        assert_clean(d)
    finally:
        bridge.stop()


def test_a_push_begun_before_a_decoder_restart_never_touches_the_new_one_s_allocation(
    nodes,
) -> None:
    """The prefiller's connection reconnects to the decoder restarted behind the same
    endpoint, and its push goes on naming the allocation the old process gave it: the
    new process must not take it for one of its own (an id it has also handed out),
    or a stale write or commit would land in, or end, another prefiller's push."""
    port = free_port()
    layer_s = 5.0  # the decoder restarts (a few seconds) between two of its layers
    p = nodes("pre", "sender", "zmq", timeout_s=4 * layer_s)
    d = nodes("dec", "receiver", "zmq", port=port)
    push(p, d, 1, "t-stale", layer_s)
    started_pushing(d)
    d.kill()
    # Its allocations live long enough to see the whole stale push out.
    d2 = nodes("dec2", "receiver", "zmq", port=port, timeout_s=layer_s)
    # Another prefiller (by hand: the test controls each step) allocates on it.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger, sock.rcvtimeo = 0, 5000
    sock.connect(d2.endpoint)
    try:

        def ask(msg: proto.Request, *frames: bytes) -> proto.Reply:
            sock.send_multipart([proto.encode(msg), *frames])
            return proto.decode_reply(sock.recv_multipart()[:1])

        v = proto.PROTOCOL_VERSION
        want = d2(op="keys", seed=2)
        alloc = proto.AllocChunks(
            1, v, "t-new", want["keys"], want["shape"], want["dtype"], want["fmt"],
            PROMPT % 16, time.time() + 4 * layer_s,
        )  # fmt: skip
        reply = ask(alloc)
        assert isinstance(reply, proto.AllocChunksReply), reply
        frames = [bytes([7 + i]) * slot.nbytes for i, slot in enumerate(reply.slots)]
        ok = ask(proto.PushChunks(2, v, reply.alloc_id, -1, list(range(len(frames)))), *frames)
        assert isinstance(ok, proto.PushChunksReply), ok
        done = p(op="pushed", timeout_s=4 * layer_s + 5)
        assert done["pushed"] == 0, done
        s = d2.state()
        assert s["rejected"] == 0 and s["received"] == 0 and s["inflight"] == 1, s
        # Nothing the stale push sent landed in the new push's buffers: its commit
        # verifies every chunk.
        sums = [payload_checksum(f) for f in frames]
        done = ask(proto.CommitChunks(3, v, reply.alloc_id, sums))
        assert done == proto.CommitChunksReply(3, len(frames), 0), done
    finally:
        sock.close(0)
        ctx.term()
