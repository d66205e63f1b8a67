"""The controller's Move: what it refuses as a whole, how it splits keys by rank, and
that a move removes from the source only what the destination confirmed (workers
played by a fake push that answers each Command; no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller import move
from kvmesh.services.controller.admin import AdminFanout
from kvmesh.services.controller.registry import Registry

NS = ["00000000000000a0", "00000000000000a1"]  # rank 0, rank 1


def key(rank: int, i: int) -> str:
    return f"{NS[rank]}-{i:032x}"


def registry(*workers: tuple[str, int, int, str, str]) -> Registry:
    reg = Registry()
    for inst, rank, size, ns, p2p in workers:
        reg.register(inst, rank, size, [ns], p2p, 1.0, f"{inst}/{rank}".encode())
    return reg


def two_by_two() -> Registry:
    return registry(
        ("A", 0, 2, NS[0], "tcp://a:0"),
        ("A", 1, 2, NS[1], "tcp://a:1"),
        ("B", 0, 2, NS[0], "tcp://b:0"),
        ("B", 1, 2, NS[1], "tcp://b:1"),
    )


@pytest.mark.parametrize(
    ("src", "dst", "keys", "why"),
    [
        ("nope", "B", [], "unknown instance 'nope'"),
        ("A", "nope", [], "unknown instance 'nope'"),
        ("A", "A", [], "both 'A'"),
        ("A", "C", [], "world size 2, C 1"),
        ("A", "D", [], "other namespaces"),
        ("A", "B", ["bad"], "not a chunk key"),
        ("A", "B", ["00000000000000ff-" + "00" * 16], "not one A registered"),
    ],
)
def test_refused_as_a_whole(src: str, dst: str, keys: list[str], why: str) -> None:
    reg = two_by_two()
    reg.register("C", 0, 1, [NS[0]], "tcp://c:0", 1.0, b"c")
    reg.register("D", 0, 2, ["00000000000000d0"], "tcp://d:0", 1.0, b"d")
    reg.register("D", 1, 2, [NS[1]], "tcp://d:1", 1.0, b"d1")
    with pytest.raises(move.MoveRefused, match=why):
        move.plan(reg, proto.Move(1, "e", keys, src, dst))


def test_keys_go_to_the_rank_of_their_namespace() -> None:
    plans = move.plan(two_by_two(), proto.Move(1, "e", [key(1, 1), key(1, 2)], "A", "B"))
    assert [(p.src_id, p.dst_id, p.keys) for p in plans] == [("A/1", "B/1", [key(1, 1), key(1, 2)])]
    everything = move.plan(two_by_two(), proto.Move(1, "e", [], "A", "B"))
    assert [(p.dst_id, p.keys) for p in everything] == [("B/0", None), ("B/1", None)]


Answer = Callable[[proto.Command, str], proto.CommandReply | None]


def run(
    reg: Registry, msg: proto.Move, answer: Answer, forge: Answer | None = None
) -> tuple[list, list]:
    """Run msg with workers played by answer (None: the worker stays silent); forge's
    replies to a command arrive from another connection, before the worker's."""
    sent: list[tuple[str, proto.Command]] = []

    async def main() -> list[proto.WorkerResult]:
        loop = asyncio.get_running_loop()
        fanout: AdminFanout

        def push(peer: bytes, cmd: proto.Command) -> bool:
            sent.append((peer.decode(), cmd))
            forged = forge(cmd, peer.decode()) if forge is not None else None
            if forged is not None:
                loop.call_soon(fanout.on_reply, b"intruder", forged)
            reply = answer(cmd, peer.decode())
            if reply is not None:
                loop.call_soon(fanout.on_reply, peer, reply)
            return True

        fanout = AdminFanout(push, 0.3)
        results = await move.run(fanout, msg, move.plan(reg, msg))
        assert fanout.events[msg.event_id] == (True, results)
        return results

    return asyncio.run(main()), sent


def reply(cmd: proto.Command, worker: str, **kw) -> proto.CommandReply:
    return proto.CommandReply(cmd.rid, worker, kw.pop("ok", True), **kw)


def test_move_removes_only_what_the_destination_confirmed() -> None:
    held = {"A/0": [key(0, 1), key(0, 2), key(0, 3)], "A/1": [key(1, 1)]}

    def answer(cmd: proto.Command, worker: str) -> proto.CommandReply | None:
        if cmd.op == "keys":
            return reply(cmd, worker, keys=held[worker])
        if cmd.op == "fetch":
            assert cmd.source == f"tcp://a:{worker[-1]}" and 0 < cmd.deadline_s < 0.3
            got = [k for k in cmd.keys if k != key(0, 2)]  # key(0, 2) failed its check
            return reply(cmd, worker, ok=len(got) == len(cmd.keys), count=len(got), keys=got)
        assert cmd.op == "remove"
        return reply(cmd, worker, count=len(cmd.keys), detail={"removed": len(cmd.keys)})

    results, sent = run(two_by_two(), proto.Move(1, "mv", [], "A", "B"), answer)
    removes = {w: c.keys for w, c in sent if c.op == "remove"}
    assert removes == {"A/0": [key(0, 1), key(0, 3)], "A/1": [key(1, 1)]}
    by = {r.worker_id: r for r in results}
    assert (by["B/0"].ok, by["B/0"].count, by["B/1"].ok) == (False, 2, True)
    assert (by["A/0"].count, by["A/1"].count) == (2, 1)


def test_copy_never_removes_and_a_silent_destination_loses_nothing() -> None:
    def answer(cmd: proto.Command, worker: str) -> proto.CommandReply | None:
        if cmd.op == "fetch":
            return None  # a dead destination
        return reply(cmd, worker, keys=[key(int(worker[-1]), 1)])

    results, sent = run(two_by_two(), proto.Move(1, "mv", [], "A", "B"), answer)
    assert not [c for _, c in sent if c.op == "remove"]
    by = {r.worker_id: r for r in results}
    assert (by["B/0"].ok, by["B/0"].error, by["A/0"].ok, by["A/0"].count) == (
        False,
        "timeout",
        True,
        0,
    )
    ok = lambda cmd, w: reply(cmd, w, keys=list(cmd.keys) or [key(int(w[-1]), 1)])  # noqa: E731
    results, sent = run(two_by_two(), proto.Move(1, "cp", [], "A", "B", True), ok)
    assert [c.op for _, c in sent].count("remove") == 0
    assert sorted(r.worker_id for r in results) == ["B/0", "B/1"]


def test_a_reply_from_another_connection_or_worker_confirms_nothing() -> None:
    held = {"A/0": [key(0, 1)], "A/1": [key(1, 1)]}

    def answer(cmd: proto.Command, worker: str) -> proto.CommandReply | None:
        if cmd.op == "keys":
            return reply(cmd, worker, keys=held[worker])
        if cmd.op == "fetch":
            # From the right connection but naming another worker: not its answer.
            return reply(cmd, "B/9", count=len(cmd.keys), keys=cmd.keys)
        return reply(cmd, worker, count=len(cmd.keys))

    def forge(cmd: proto.Command, worker: str) -> proto.CommandReply | None:
        if cmd.op != "fetch":
            return None
        return reply(cmd, worker, count=len(cmd.keys), keys=cmd.keys)  # the right worker id

    results, sent = run(two_by_two(), proto.Move(1, "mv", [], "A", "B"), answer, forge)
    assert not [c for _, c in sent if c.op == "remove"]
    by = {r.worker_id: r for r in results}
    assert (by["B/0"].ok, by["B/0"].error, by["B/1"].error) == (False, "timeout", "timeout")


def test_a_reply_over_the_workers_new_connection_counts() -> None:
    """A long fetch may end after its worker reconnected (a new routing id): its reply
    comes over the connection the worker has now, and still counts; one over a
    connection that is neither the old nor the current one does not."""
    current = {"A/0": b"old"}

    async def main() -> tuple[bool, bool, proto.CommandReply]:
        sent: list[proto.Command] = []
        fanout = AdminFanout(lambda peer, cmd: sent.append(cmd) or True, 1.0, peer_of=current.get)
        worker = two_by_two().workers["A/0"]
        worker.peer = b"old"
        asked = asyncio.ensure_future(fanout.ask(worker, "e", "health"))
        await asyncio.sleep(0)
        current["A/0"] = b"new"  # re-registered meanwhile
        answer = reply(sent[0], "A/0", count=7)
        intruder = fanout.on_reply(b"intruder", answer)
        renewed = fanout.on_reply(b"new", answer)
        return intruder, renewed, await asked

    intruder, renewed, got = asyncio.run(main())
    assert (intruder, renewed, got.ok, got.count) == (False, True, True, 7)


def test_command_rids_start_at_a_random_value_each_run() -> None:
    starts = set()
    for _ in range(3):

        async def first_rid() -> int:
            rids: list[int] = []
            fanout = AdminFanout(lambda peer, cmd: rids.append(cmd.rid) or False, 0.1)
            await fanout.run("e", "health", list(two_by_two().workers.values())[:1], "", [])
            return rids[0]

        starts.add(asyncio.run(first_rid()))
    assert len(starts) == 3


def test_per_rank_errors() -> None:
    reg = registry(
        ("A", 0, 2, NS[0], ""),  # serves no P2P
        ("A", 1, 2, NS[1], "tcp://a:1"),
        ("B", 0, 2, NS[0], "tcp://b:0"),  # B has no rank 1
    )
    results, sent = run(reg, proto.Move(1, "e", [], "A", "B", True), lambda c, w: None)
    by = {r.worker_id: r.error for r in results}
    assert "A/0 serves no P2P endpoint" in by["B/0"]
    assert "B has no worker for this rank" in by["B/1"]
    assert sent == []
