"""`Move` through a real controller and real engines (P2P on, NIXL and ZMQ channels),
each in its own process: `copy` lands the chunks in the destination's L1 bitwise equal
and leaves the source's; `move` takes them off the source; the registry names the
holders; a dead or unknown instance, a source without P2P, instances whose namespaces
differ and chunks that fail their checksum get clear errors and change nothing; the
HTTP API and the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtest.controller import ControllerProcess
from kvtest.service_process import KvtestProcess
from kvtest.waiting import wait_for

from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import ControllerConnection, ControllerError


class Node(KvtestProcess):
    """An engine (kvtest.move_node) registered with the controller."""

    def __init__(self, ctl: ControllerProcess, name: str, channel: str, **cfg: object) -> None:
        cfg = {"name": name, "url": ctl.url, "channel": channel, **cfg}
        super().__init__(
            f"node {name}",
            "move_node",
            [json.dumps(cfg)],
            log=ctl.workdir / f"node-{name}.log",
            ready_line="{",
        )
        self.name = name
        self.launch()

    def ready(self) -> dict:
        info = self.wait_ready(60.0)
        assert "error" not in info, info
        return info

    def chunks(self, keys: list[str]) -> dict[str, str | None]:
        return self(op="chunks", keys=keys)["chunks"]

    def l1(self) -> set[str]:
        return set(self(op="l1")["keys"])


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    srv = ControllerProcess(tmp_path, snapshot=False).start()  # admin timeout 2 s
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


@pytest.fixture
def nodes(controller) -> Iterator:
    started: list[Node] = []

    def start(*specs: dict) -> list[Node]:
        procs = [Node(controller, **spec) for spec in specs]
        started.extend(procs)
        for p in procs:
            p.ready()
        return procs

    yield start
    for p in started:
        p.stop()


def http_post(srv: ControllerProcess, path: str, payload: object) -> tuple[int, dict]:
    req = urllib.request.Request(srv.http + path, data=json.dumps(payload).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def l1_counts(srv: ControllerProcess) -> dict[str, int]:
    with urllib.request.urlopen(srv.http + "/workers", timeout=5) as r:
        return {w["worker_id"]: w["chunks"].get("l1", 0) for w in json.loads(r.read())}


def cli(srv: ControllerProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli.main",
            "admin",
            "--url",
            srv.url,
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def by_worker(results: list[dict]) -> dict[str, dict]:
    return {r["worker_id"]: r for r in results}


def holder(srv: ControllerProcess, key: str, exclude: str) -> str:
    async def main() -> str:
        c = ControllerConnection(srv.url, timeout_s=3.0)
        await c.connect()
        try:
            reply = await c.request(
                proto.P2PLookup(c.next_rid(), [key], exclude), proto.P2PLookupReply
            )
            return reply.instance_id
        finally:
            await c.close()

    return asyncio.run(main())


@pytest.mark.parametrize("channel", ["nixl", "zmq"])
def test_copy_then_move_between_two_engines(controller, nodes, channel: str) -> None:
    a_name, b_name = f"A{channel}", f"B{channel}"
    a, b = nodes(
        {"name": a_name, "channel": channel, "seed": 1},
        {"name": b_name, "channel": channel},
    )
    assert a(op="info")["channel"] == channel
    keys1 = a(op="store", seed=7, n=80)["keys"]  # 5 chunks of 16 tokens
    assert len(keys1) == 5
    wait_for(lambda: l1_counts(controller).get(f"{a_name}/0") == 5, what="A's admits")
    original = a.chunks(keys1)

    # copy (HTTP, given keys): B holds them bitwise equal, A keeps them, both registered.
    status, out = http_post(
        controller,
        "/copy",
        {"src_instance": a_name, "dst_instance": b_name, "keys": keys1, "event_id": "c1"},
    )
    assert status == 200, out
    assert out["event_id"] == "c1"
    [res] = out["results"]
    assert (res["worker_id"], res["ok"], res["count"]) == (f"{b_name}/0", True, 5), res
    assert res["detail"] == {"requested": 5, "copied": 5, "present": 0, "failed": 0}
    assert b.chunks(keys1) == original
    assert a.chunks(keys1) == original
    wait_for(lambda: l1_counts(controller).get(f"{b_name}/0") == 5, what="B's admits")
    assert l1_counts(controller)[f"{a_name}/0"] == 5
    assert holder(controller, keys1[0], exclude=b_name) == a_name
    assert holder(controller, keys1[0], exclude=a_name) == b_name

    # move (CLI, no keys: everything A holds in L1): B confirms all, A loses all.
    keys2 = a(op="store", seed=8, n=48)["keys"]
    original.update(a.chunks(keys2))
    done = cli(controller, "move", "--from", a_name, "--to", b_name)
    assert done.returncode == 0, done.stdout + done.stderr
    results = by_worker(json.loads(done.stdout)["results"])
    fetched, removed = results[f"{b_name}/0"], results[f"{a_name}/0"]
    assert fetched["ok"] and fetched["detail"] == {
        "requested": 8,
        "copied": 3,
        "present": 5,
        "failed": 0,
    }
    assert removed["ok"] and removed["detail"] == {"removed": 8, "kept": 0}
    assert a.l1() == set()
    assert b.chunks(keys1 + keys2) == original
    wait_for(
        lambda: l1_counts(controller) == {f"{a_name}/0": 0, f"{b_name}/0": 8},
        what="the registry after the move",
    )
    assert holder(controller, keys2[0], exclude="") == b_name


def test_failures_change_nothing(controller, nodes, tmp_path: Path) -> None:
    # D registers with a long heartbeat, so the controller still lists it once killed.
    a, b, d = nodes(
        {"name": "FA", "channel": "zmq", "seed": 3},
        {"name": "FB", "channel": "zmq"},
        {"name": "FD", "channel": "zmq", "heartbeat_s": 10.0},
    )
    keys = a(op="store", seed=9, n=64)["keys"]
    keys_d = d(op="store", seed=10, n=32)["keys"]
    wait_for(
        lambda: l1_counts(controller).get("FA/0") == 4 and l1_counts(controller).get("FD/0") == 2,
        what="admits",
    )
    original = a.chunks(keys)

    status, out = http_post(controller, "/copy", {"src_instance": "nope", "dst_instance": "FB"})
    assert status == 400 and "unknown instance 'nope'" in out["error"], out
    status, out = http_post(controller, "/move", {"src_instance": "FA", "dst_instance": "FA"})
    assert status == 400 and "both" in out["error"], out
    assert http_post(controller, "/move", {"src_instance": "FA"})[0] == 400
    status, out = http_post(controller, "/copy", {"src_instance": "FA", "dst_instance": "no"})
    assert status == 400 and "unknown instance 'no'" in out["error"], out

    d.kill()
    # A dead destination: the fetch times out, so the move removes nothing from A.
    t0 = time.monotonic()
    status, out = http_post(controller, "/move", {"src_instance": "FA", "dst_instance": "FD"})
    assert time.monotonic() - t0 < 6.0
    assert status == 200, out
    res = by_worker(out["results"])
    assert (res["FD/0"]["ok"], res["FD/0"]["error"]) == (False, "timeout")
    assert res["FA/0"] == {"worker_id": "FA/0", "ok": True, "count": 0, "error": "",
                           "detail": {"removed": 0, "kept": 0}}  # fmt: skip
    assert a.chunks(keys) == original
    # A dead source: its listing times out, or (keys given) its P2P endpoint is a miss.
    status, out = http_post(controller, "/move", {"src_instance": "FD", "dst_instance": "FB"})
    assert status == 200
    [res_b] = out["results"][:1]
    assert not res_b["ok"] and "listing the chunks of FD/0: timeout" in res_b["error"], res_b
    done = cli(controller, "move", "--from", "FD", "--to", "FB", *keys_d)
    assert done.returncode == 1, done.stderr
    res = by_worker(json.loads(done.stdout)["results"])
    assert not res["FB/0"]["ok"] and res["FB/0"]["detail"]["failed"] == 2, res
    assert res["FD/0"]["detail"] == {"removed": 0, "kept": 0}  # nothing confirmed, not asked
    assert b.l1() == set()
    assert l1_counts(controller)["FA/0"] == 4

    async def fakes() -> None:
        # Registered by hand: a source without P2P, instances of other namespaces or
        # world size. Chunk keys begin with their namespace id: FA's is keys[0][:16].
        c = ControllerConnection(controller.url, timeout_s=3.0)
        await c.connect()
        try:
            for inst, rank, size, ns, p2p in (
                ("FN", 0, 1, keys[0][:16], ""),
                ("FP", 0, 1, "0123456789abcdef", "tcp://127.0.0.1:9"),
                ("FW", 0, 2, keys[0][:16], "tcp://127.0.0.1:9"),
            ):
                reg = proto.Register(c.next_rid(), inst, rank, size, [ns], p2p, 30.0)
                await c.request(reg, proto.RegisterReply)
            copied = await c.request(
                proto.Move(c.next_rid(), "m1", [], "FN", "FB", True), proto.AdminReply
            )
            [res] = copied.results
            assert (res.worker_id, res.ok) == ("FB/0", False)
            assert "FN/0 serves no P2P endpoint" in res.error

            async def refused(msg: proto.Move) -> str:
                with pytest.raises(ControllerError) as exc:
                    await c.request(msg, proto.AdminReply)
                assert exc.value.code == proto.ErrorCode.BAD_REQUEST
                return str(exc.value)

            assert "other namespaces" in await refused(
                proto.Move(c.next_rid(), "m2", [], "FA", "FP", True)
            )
            assert "world size" in await refused(proto.Move(c.next_rid(), "m3", [], "FA", "FW"))
            stranger = "0123456789abcdef-" + "00" * 16
            assert "not one FA registered" in await refused(
                proto.Move(c.next_rid(), "m4", [stranger], "FA", "FB")
            )
            assert "not a chunk key" in await refused(
                proto.Move(c.next_rid(), "m5", ["bad"], "FA", "FB")
            )
        finally:
            await c.close()

    asyncio.run(fakes())
    assert a.chunks(keys) == original and b.l1() == set()

    # Chunks that fail their check at the destination are dropped there, so the move
    # leaves them on the source.
    assert a(op="corrupt")["corrupted"] == 4
    status, out = http_post(controller, "/move", {"src_instance": "FA", "dst_instance": "FB"})
    assert status == 200, out
    res = by_worker(out["results"])
    assert not res["FB/0"]["ok"] and res["FB/0"]["detail"]["failed"] == 4, res
    assert res["FA/0"]["detail"] == {"removed": 0, "kept": 0}
    assert b.l1() == set() and a.l1() == set(keys)
