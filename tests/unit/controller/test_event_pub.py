"""The KV-event feed's publishing logic without sockets: messages per namespace, seq and
prev_seq, nothing done while nobody listens, and a new epoch after a silence."""

from __future__ import annotations

import pytest

from kvmesh.common.config import ConfigError, load_config
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import kv_events as kv
from kvmesh.services.controller.event_pub import EventPublisher
from kvmesh.services.controller.registry import Registry

NS_A, NS_B = "0123456789abcdef", "fedcba9876543210"


def key(ns: str, i: int) -> str:
    return f"{ns}-{i:032x}"


def publisher(size: int = 1000) -> tuple[EventPublisher, object]:
    pub = EventPublisher(Metrics(), replay_size=size)
    entry = Registry().register("I", 0, 1, [NS_A], "", 1.0, b"peer")
    return pub, entry


def kept(pub: EventPublisher) -> list[tuple[int, str, kv.Payload]]:
    assert pub.ring is not None
    return [(k.seq, k.topic, kv.decode_payload(k.payload)) for k in pub.ring.since(0)]


def test_one_message_per_namespace_with_seq_and_prev_seq() -> None:
    pub, entry = publisher()
    pub.topics.add(b"")  # what a subscriber's b"\x01" tells the XPUB
    pub.events(entry, [(1, key(NS_A, 1), "l1"), (1, key(NS_B, 2), "l1"), (2, key(NS_A, 3), "disk")])
    pub.events(entry, [(1, key(NS_A, 4), "l1"), (1, "not-a-key", "l1"), (1, key("XYZ", 5), "l1")])
    msgs = kept(pub)
    assert [(s, t) for s, t, _ in msgs] == [(1, NS_A), (2, NS_B), (3, NS_A)]
    assert [p.prev_seq for _, _, p in msgs] == [0, 0, 1]
    first = msgs[0][2]
    assert isinstance(first, kv.EventBatch) and first.epoch == pub.epoch
    assert (first.worker_id, first.instance_id) == ("I/0", "I")
    assert first.events == [
        kv.KVEvent("stored", key(NS_A, 1), "l1"),
        kv.KVEvent("removed", key(NS_A, 3), "disk"),
    ]
    assert msgs[2][2].events == [kv.KVEvent("stored", key(NS_A, 4), "l1")]  # bad keys skipped
    assert pub.seq == 3


def test_state_and_left_reach_every_namespace_of_the_worker() -> None:
    pub, entry = publisher()
    pub.topics.add(NS_A.encode())
    pub.events(entry, [(1, key(NS_B, 1), "l1")])  # a tenant's namespace, not registered
    assert len(list(pub.state(entry, {"l1": [key(NS_A, 7)]}))) == 1  # one step
    pub.left(entry, "dropped")
    msgs = kept(pub)
    kinds = [(t, type(p).__name__) for _, t, p in msgs]
    assert kinds == [
        (NS_B, "EventBatch"),
        (NS_A, "WorkerState"),
        (NS_B, "WorkerState"),
        (NS_A, "WorkerLeft"),
        (NS_B, "WorkerLeft"),
    ]
    assert msgs[1][2].events == [kv.KVEvent("stored", key(NS_A, 7), "l1")]
    assert msgs[2][2].events == []  # B: nothing any more
    assert msgs[4][2].reason == "dropped" and msgs[4][2].prev_seq == 3


def test_nobody_listening_costs_nothing_then_a_new_epoch() -> None:
    pub, entry = publisher()
    epoch = pub.epoch
    pub.events(entry, [(1, key(NS_A, 1), "l1")])
    assert pub.seq == 0 and kept(pub) == []
    # The first subscriber: nothing of this epoch was published, so it goes on.
    pub.topics.add(b"")
    pub.events(entry, [(1, key(NS_A, 2), "l1")])
    assert (pub.epoch, pub.seq) == (epoch, 1)
    # Everybody leaves, a change goes unpublished, someone comes back: what was
    # missed cannot be replayed, so the stream starts over in a new epoch.
    pub.topics.clear()
    pub.events(entry, [(1, key(NS_A, 3), "l1")])
    pub.topics.add(b"")
    pub.events(entry, [(1, key(NS_A, 4), "l1")])
    assert pub.epoch != epoch and pub.seq == 1
    ((seq, _, payload),) = kept(pub)
    assert (seq, payload.prev_seq, payload.epoch) == (1, 0, pub.epoch)


def test_a_replay_port_needs_the_feed() -> None:
    with pytest.raises(ConfigError, match="events_replay_port"):
        load_config(None, env={}, overrides={"controller.events_replay_port": 7651})
    cfg = load_config(
        None,
        env={},
        overrides={"controller.events_port": 7650, "controller.events_replay_port": 7651},
    )
    assert (cfg.controller.events_port, cfg.controller.events_replay_size) == (7650, 100_000)
