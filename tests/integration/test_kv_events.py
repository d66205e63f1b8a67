"""The controller's KV-event feed, end to end: a real controller process, real engines
storing and clearing chunks, subscribers on the PUB socket and requests to the replay
socket (common/protocol/kv_events.py, services/controller/event_pub.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from click.testing import CliRunner
from kvtest.controller import ControllerProcess, build_engine, store, tokens
from kvtest.waiting import wait_for

from kvmesh.common.config import load_config
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.common.transport.curve import CurveKeys, apply_client, load_curve
from kvmesh.common.transport.kv_events_client import (
    Delivery,
    KvEventsSubscriber,
    Lost,
    ReplayError,
)
from kvmesh.services.cli.main import cli

CHUNK = 8
WAIT_S = 10.0  # a loaded 2-core box: generous deadlines, never sleeps
QUIET_S = 0.6  # how long "nothing arrives" is watched for
NS = "00112233445566ff"


def health(ctl: ControllerProcess) -> dict:
    with urllib.request.urlopen(f"{ctl.http}/health", timeout=5) as resp:
        return json.loads(resp.read())


def subscribed(ctl: ControllerProcess, topics: int = 1) -> None:
    """Wait until the controller has read `topics` subscriptions: before that it
    publishes nothing."""
    wait_for(
        lambda: health(ctl)["event_feed"]["topics"] >= topics, timeout=WAIT_S, what="subscription"
    )


def deliveries(items: list) -> list[Delivery]:
    assert not [i for i in items if isinstance(i, Lost)], items
    return [i for i in items if isinstance(i, Delivery)]


def events_of(items: list[Delivery]) -> list[tuple[str, str, str]]:
    return [
        (e.op, e.key, e.tier)
        for d in items
        if isinstance(d.payload, kv.EventBatch)
        for e in d.payload.events
    ]


async def collect(sub: KvEventsSubscriber, until, wait_s: float = WAIT_S) -> list:
    """Items until until(items) holds (or the deadline: the caller's assert says what)."""
    out: list = []
    try:
        async with asyncio.timeout(wait_s):
            async for item in sub:
                out.append(item)
                if until(out):
                    break
    except TimeoutError:
        pass
    return out


def n_events(n: int):
    return lambda items: len(events_of([i for i in items if isinstance(i, Delivery)])) >= n


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    with ControllerProcess(tmp_path, snapshot=False, events=True).start() as ctl:
        yield ctl


def test_stored_removed_and_left_in_seq_order(controller: ControllerProcess) -> None:
    async def main() -> None:
        async with KvEventsSubscriber(controller.events_url, controller.replay_url) as sub:
            await asyncio.to_thread(subscribed, controller)
            eng = await asyncio.to_thread(build_engine, "A", controller.url)
            try:
                toks = tokens(6 * CHUNK, 1)
                keys = await asyncio.to_thread(store, eng, toks)
                assert len(keys) == 6
                got = deliveries(await collect(sub, n_events(6)))
                assert sorted(events_of(got)) == sorted(("stored", k, "l1") for k in keys)
                # Whole messages: one topic (the engine's namespace), seqs 1, 2, ... with
                # each message's prev_seq the one before it.
                ns = eng.namespace.ns_id
                assert {d.topic for d in got} == {ns}
                seqs = [d.seq for d in got]
                assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
                assert [d.payload.prev_seq for d in got[1:]] == seqs[:-1]
                assert all(d.payload.worker_id == "A/0" and not d.replayed for d in got)
                # Two chunks cleared: "removed" for exactly those.
                assert await asyncio.to_thread(eng.clear, toks[: 2 * CHUNK]) == 2
                more = deliveries(await collect(sub, n_events(2)))
                assert sorted(events_of(more)) == sorted(("removed", k, "l1") for k in keys[:2])
                assert more[0].seq == seqs[-1] + 1
            finally:
                await asyncio.to_thread(eng.close)
            left = deliveries(await collect(sub, lambda items: len(items) >= 1))
            assert isinstance(left[0].payload, kv.WorkerLeft)
            assert (left[0].payload.worker_id, left[0].payload.reason) == ("A/0", "deregistered")
            assert left[0].topic == ns

    asyncio.run(main())


def test_namespace_filter(controller: ControllerProcess) -> None:
    a = build_engine("TA", controller.url, tenant_salt="tenant-a")
    b = build_engine("TB", controller.url, tenant_salt="tenant-b")
    ns_a, ns_b = a.namespace.ns_id, b.namespace.ns_id
    assert ns_a != ns_b

    async def main() -> None:
        only_a = KvEventsSubscriber(controller.events_url, controller.replay_url, namespaces=[ns_a])
        every = KvEventsSubscriber(controller.events_url, controller.replay_url)
        await only_a.connect()
        await every.connect()
        try:
            await asyncio.to_thread(subscribed, controller, 2)
            keys_b = await asyncio.to_thread(store, b, tokens(3 * CHUNK, 2))
            keys_a = await asyncio.to_thread(store, a, tokens(2 * CHUNK, 3))
            all_items = deliveries(await collect(every, n_events(5)))
            assert sorted(k for _, k, _ in events_of(all_items)) == sorted(keys_a + keys_b)
            mine = deliveries(await collect(only_a, n_events(2)))
            assert sorted(k for _, k, _ in events_of(mine)) == sorted(keys_a)
            assert {d.topic for d in mine} == {ns_a}
            # Nothing of B's comes later either: the unfiltered view saw it all go by.
            assert await collect(only_a, lambda items: True, wait_s=QUIET_S) == []
            assert only_a.replays == 0  # B's seqs are no gap to a subscriber of A's
        finally:
            await only_a.close()
            await every.close()

    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()


def recv_events(sock: zmq.Socket, n: int) -> list[list[bytes]]:
    """Raw PUB messages from sock until they hold n events."""
    frames: list[list[bytes]] = []
    seen = 0
    while seen < n:
        f = sock.recv_multipart()
        frames.append(f)
        payload = kv.decode_payload(f[2])
        seen += len(payload.events) if isinstance(payload, kv.EventBatch) else 0
    return frames


def raw_sub(ctx: zmq.Context, url: str) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    s.setsockopt(zmq.LINGER, 0)
    s.connect(url)
    return s


def test_missed_messages_come_back_through_replay(controller: ControllerProcess) -> None:
    eng = build_engine("R", controller.url)
    ctx = zmq.Context()
    raw = raw_sub(ctx, controller.events_url)

    async def main() -> None:
        subscribed(controller)
        toks = tokens(8 * CHUNK, 4)
        frames = []
        for i in range(4):  # four stores of two new chunks, each seen: four messages or more
            await asyncio.to_thread(store, eng, toks[: (i + 1) * 2 * CHUNK])
            frames += await asyncio.to_thread(recv_events, raw, 2)
        assert len(frames) >= 4
        seqs = [kv.decode_seq(f[1]) for f in frames]
        assert seqs == list(range(1, len(frames) + 1))

        # A subscriber that comes late asks for everything since seq 0.
        async with KvEventsSubscriber(
            controller.events_url, controller.replay_url, since=0
        ) as late:
            got = deliveries(await collect(late, lambda items: len(items) >= len(frames)))
        assert [d.seq for d in got] == seqs
        assert all(d.replayed for d in got)
        assert [d.payload for d in got] == [kv.decode_payload(f[2]) for f in frames]

        # A lossy subscriber: the same frames handed over with two in the middle lost
        # on the way; the gap is filled from the replay socket, exactly.
        lossy = KvEventsSubscriber(controller.events_url, controller.replay_url)
        try:
            lost = {1, 2}
            out: list = []
            for i, f in enumerate(frames):
                if i not in lost:
                    out += await lossy.accept(f)
            got = deliveries(out)
            assert [d.seq for d in got] == seqs
            assert [d.replayed for d in got] == [i in lost for i in range(len(frames))]
            assert [d.payload for d in got] == [kv.decode_payload(f[2]) for f in frames]
            assert lossy.replays == 1
            # A copy of what was already handed over (the PUB after a replay) is dropped.
            assert await lossy.accept(frames[2]) == []
        finally:
            await lossy.close()

    try:
        asyncio.run(main())
    finally:
        raw.close(0)
        ctx.term()
        eng.close()


def test_changes_nobody_heard_open_a_new_epoch(controller: ControllerProcess) -> None:
    """The only subscriber leaves, chunks are stored, it comes back: those changes were
    never published, so the feed starts a new epoch and the subscriber is told."""
    eng = build_engine("E", controller.url)
    ctx = zmq.Context()
    try:
        raw = raw_sub(ctx, controller.events_url)
        subscribed(controller)
        toks = tokens(6 * CHUNK, 9)
        store(eng, toks[: 2 * CHUNK])
        before = recv_events(raw, 2)
        old = health(controller)["event_feed"]
        raw.close(0)  # the XPUB hears the unsubscription of a closed connection
        wait_for(lambda: health(controller)["event_feed"]["topics"] == 0, what="unsubscribed")
        store(eng, toks[: 4 * CHUNK])  # nobody hears this
        wait_for(lambda: chunk_count(controller, "E/0") == 4, what="the unheard admits")
        assert health(controller)["event_feed"]["seq"] == old["seq"]  # nothing published
        raw = raw_sub(ctx, controller.events_url)
        subscribed(controller)
        store(eng, toks)
        after = recv_events(raw, 2)
        raw.close(0)
        new = health(controller)["event_feed"]
        assert new["epoch"] != old["epoch"] and kv.decode_seq(after[0][1]) == 1

        async def main() -> list:
            follower = KvEventsSubscriber(controller.events_url, controller.replay_url)
            try:
                out: list = []
                for f in before + after:
                    out += await follower.accept(f)
                return out
            finally:
                await follower.close()

        out = asyncio.run(main())
        lost = [i for i in out if isinstance(i, Lost)]
        assert len(lost) == 1 and lost[0].reason == "controller epoch changed"
        assert [d.seq for d in out if isinstance(d, Delivery)] == [
            kv.decode_seq(f[1]) for f in before + after
        ]
    finally:
        ctx.term()
        eng.close()


def chunk_count(ctl: ControllerProcess, worker: str) -> int:
    with urllib.request.urlopen(f"{ctl.http}/workers", timeout=5) as resp:
        workers = json.loads(resp.read())
    return sum(sum(w["chunks"].values()) for w in workers if w["worker_id"] == worker)


def test_full_state_and_a_silent_worker_dropped(controller: ControllerProcess) -> None:
    """A worker's FullState restates its chunks per namespace; one that stops
    heartbeating is dropped by the controller, and the feed says so."""

    async def main() -> None:
        async with KvEventsSubscriber(controller.events_url, controller.replay_url) as sub:
            await asyncio.to_thread(subscribed, controller)
            worker = ControllerConnection(controller.url, timeout_s=WAIT_S)
            await worker.connect()
            try:
                reg = await worker.request(
                    proto.Register(worker.next_rid(), "S", 0, 1, [NS], "", 0.1),
                    proto.RegisterReply,
                )
                other = "0f" * 8
                keys = [f"{NS}-{i:032x}" for i in range(2)] + [f"{other}-{9:032x}"]
                await worker.request(
                    proto.FullState(worker.next_rid(), reg.worker_id, 0, {"disk": keys}),
                    proto.FullStateReply,
                )
                # Never a heartbeat: dropped after heartbeat_misses (3) x 0.1 s.
                got = deliveries(await collect(sub, lambda items: len(items) >= 4))
            finally:
                await worker.close()
        states = {d.topic: d.payload for d in got if isinstance(d.payload, kv.WorkerState)}
        assert set(states) == {NS, other}
        assert states[NS].events == [kv.KVEvent("stored", k, "disk") for k in keys[:2]]
        assert states[other].events == [kv.KVEvent("stored", keys[2], "disk")]
        left = {d.topic: d.payload for d in got if isinstance(d.payload, kv.WorkerLeft)}
        assert set(left) == {NS, other}
        assert {p.reason for p in left.values()} == {"dropped"}
        assert [d.seq for d in got] == [1, 2, 3, 4]

    asyncio.run(main())


def test_too_old_and_malformed_replays(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path, snapshot=False, events=True)
    ctl.env["KVMESH_CONTROLLER__EVENTS_REPLAY_SIZE"] = "4"
    with ctl.start():
        eng = build_engine("O", ctl.url)

        async def main() -> None:
            async with KvEventsSubscriber(ctl.events_url, ctl.replay_url) as sub:
                await asyncio.to_thread(subscribed, ctl)
                toks = tokens(6 * CHUNK, 6)
                for i in range(3):  # three messages of two events: the first is dropped
                    await asyncio.to_thread(store, eng, toks[: (i + 1) * 2 * CHUNK])
                    await collect(sub, n_events(2))
                with pytest.raises(ReplayError) as err:
                    await sub.replay(0)
                assert err.value.code == kv.ErrorCode.TOO_OLD
                assert "too old; resync from the controller's workers list" in str(err.value)
                entries, epoch, last = await sub.replay(1)
                assert [s for s, _, _ in entries] == [2, 3] and last == 3
                assert epoch == health(ctl)["event_feed"]["epoch"]

        try:
            asyncio.run(main())
        finally:
            eng.close()

        # Malformed requests: an error each, and the controller serves on.
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ctl.replay_url)
        enc = msgspec.msgpack.encode
        cases = [
            ([b"\xc1garbage"], kv.ErrorCode.BAD_MESSAGE),
            ([enc(["nope", 7])], kv.ErrorCode.UNKNOWN_MESSAGE),
            ([enc(["replay", 8, 1, "x"])], kv.ErrorCode.BAD_MESSAGE),
            ([kv.encode(kv.Replay(9, kv.PROTOCOL_VERSION + 1, 0))], kv.ErrorCode.VERSION_MISMATCH),
            ([kv.encode(kv.Replay(10, kv.PROTOCOL_VERSION, -1))], kv.ErrorCode.BAD_MESSAGE),
            ([kv.encode(kv.Replay(11, 1, 0, ["not-a-namespace"]))], kv.ErrorCode.BAD_MESSAGE),
            ([kv.encode(kv.Replay(12, 1, 0)), b"extra"], kv.ErrorCode.BAD_MESSAGE),
            ([kv.encode(kv.Replay(13, 1, 10**6))], kv.ErrorCode.BAD_MESSAGE),
            ([kv.encode(kv.Replay(14, 1, 0, [], "an-old-epoch"))], kv.ErrorCode.EPOCH_CHANGED),
        ]
        try:
            for frames, code in cases:
                dealer.send_multipart(frames)
                reply = kv.decode_reply(dealer.recv())
                assert isinstance(reply, kv.ErrorReply), (frames, reply)
                assert reply.code == code, (frames, reply)
            dealer.send(kv.encode(kv.Replay(20, kv.PROTOCOL_VERSION, 3)))
            end = kv.decode_reply(dealer.recv())
            assert isinstance(end, kv.ReplayEnd) and (end.rid, end.count) == (20, 0)
        finally:
            dealer.close(0)
            ctx.term()
        assert ctl.alive() and health(ctl)["status"] == "ok"


def test_cli_prints_json_lines(controller: ControllerProcess, tmp_path: Path) -> None:
    eng = build_engine("C", controller.url)
    try:
        # Someone keeps the feed going (so it is kept for replay), then the CLI asks
        # for everything since 0 and stops after the first message.
        ctx = zmq.Context()
        keeper = raw_sub(ctx, controller.events_url)
        try:
            subscribed(controller)
            keys = store(eng, tokens(4 * CHUNK, 7))
            recv_events(keeper, 4)
        finally:
            keeper.close(0)
            ctx.term()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvmesh.services.cli.main",
                "events",
                "--controller",
                "127.0.0.1",
                "--events-port",
                str(controller.events_port),
                "--replay-port",
                str(controller.events_replay_port),
                "--namespace",
                eng.namespace.ns_id,
                "--since",
                "0",
                "--json",
                "--limit",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(lines) == 1
        (m,) = lines
        assert (m["seq"], m["kind"], m["replayed"], m["worker_id"]) == (1, "events", True, "C/0")
        assert m["namespace"] == eng.namespace.ns_id
        got = [e["key"] for e in m["events"]]
        assert got and got == keys[: len(got)]
        assert {e["op"] for e in m["events"]} == {"stored"}
    finally:
        eng.close()


# -- CURVE ------------------------------------------------------------------------------


def _keys(tmp: Path) -> tuple[Path, CurveKeys, CurveKeys]:
    runner = CliRunner()
    keys = tmp / "keys"
    for name in ("server", "reader", "intruder"):
        res = runner.invoke(cli, ["keys", "generate", str(keys), "--name", name])
        assert res.exit_code == 0, res.output
    allowed = tmp / "allowed"
    allowed.mkdir()
    shutil.copy(keys / "reader.key", allowed)
    config = tmp / "kvmesh.yaml"
    clients = {}
    for name in ("reader", "intruder"):
        path = tmp / f"{name}.yaml"
        path.write_text(
            f"security:\n  server_key: {keys / 'server.key_secret'}\n"
            f"  client_key: {keys / name}.key_secret\n  allowed_clients: {allowed}\n"
        )
        c = load_curve(load_config(path, env={}).security, client=True)
        assert c is not None
        clients[name] = c
    config.write_text((tmp / "reader.yaml").read_text())
    return config, clients["reader"], clients["intruder"]


def test_curve_keeps_the_feed_to_keyed_clients(tmp_path: Path) -> None:
    config, reader, intruder = _keys(tmp_path)
    ctl = ControllerProcess(tmp_path, snapshot=False, events=True)
    ctl.env["KVMESH_CONFIG"] = str(config)
    with ctl.start():

        async def main() -> None:
            ok = KvEventsSubscriber(ctl.events_url, ctl.replay_url, curve=reader)
            await ok.connect()
            ctx = zmq.Context()
            socks = []
            for keys in (None, intruder):  # no key at all; a key the controller refuses
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.RCVTIMEO, int(QUIET_S * 1000))
                if keys is not None:
                    apply_client(s, keys, ctl.events_url)
                s.connect(ctl.events_url)
                socks.append(s)
            bad_replay = KvEventsSubscriber(
                ctl.events_url, ctl.replay_url, curve=intruder, replay_timeout_s=QUIET_S
            )
            try:
                await asyncio.to_thread(subscribed, ctl)
                worker = ControllerConnection(ctl.url, timeout_s=WAIT_S, curve=reader)
                await worker.connect()
                try:
                    reg = await worker.request(
                        proto.Register(worker.next_rid(), "K", 0, 1, [NS], "", 60.0),
                        proto.RegisterReply,
                    )
                    keys = [f"{NS}-{i:032x}" for i in range(3)]
                    worker.send(
                        proto.KVEventBatch(0, reg.worker_id, 1, [(1, k, "l1") for k in keys])
                    )
                    got = deliveries(await collect(ok, n_events(3)))
                    assert events_of(got) == [("stored", k, "l1") for k in keys]
                    entries, _, _ = await ok.replay(0)
                    assert [s for s, _, _ in entries] == [got[0].seq]  # the keyed client replays
                finally:
                    await worker.close()
                for s in socks:
                    with pytest.raises(zmq.Again):
                        s.recv_multipart()
                with pytest.raises(ReplayError):
                    await bad_replay.replay(0)
                assert health(ctl)["event_feed"]["topics"] == 1  # the keyed one only
            finally:
                for s in socks:
                    s.close(0)
                ctx.term()
                await ok.close()
                await bad_replay.close()

        asyncio.run(main())
