"""The whole mesh on loopback under traffic while its services fail.

A controller, a cache-server and two engines (each in its own process, kvtest.mesh_node:
L1, P2P located through the controller, and the cache-server as the remote tier) store
and load many distinct prompts while a test kills or freezes a service. Every call is
timed against the deadline its tiers are configured with, every loaded chunk is checked
bit for bit against the KV its tokens imply (a miss is fine, wrong KV never is), the
tier is used again once the fault ends, no L1 page is left behind, and no process
crashed.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtest.controller import ControllerProcess
from kvtest.paged import make_cache
from kvtest.remote import CacheServerProcess, RedisProcess, remote_engine
from kvtest.service_process import KvtestProcess
from kvtest.waiting import wait_for

DEADLINE_S = 0.5  # the remote's and the peers' get deadline in every engine
RECOVER_S = 10.0  # how long a tier may take to be used again once its fault ended
A_BASE, B_BASE = 1_000_000, 2_000_000  # seeds of each node's own prompts


class Node(KvtestProcess):
    """One engine process (kvtest.mesh_node) taking JSON commands."""

    def __init__(self, tmp: Path, name: str, controller: str, remote: str) -> None:
        cfg = {"name": name, "controller": controller, "remote": remote, "timeout_s": DEADLINE_S}
        super().__init__(
            f"node {name}",
            "mesh_node",
            [json.dumps(cfg)],
            log=tmp / f"node-{name}.log",
            ready_line="{",
        )
        self.info: dict = {}

    def up(self, timeout: float = 60.0) -> Node:
        self.info = self.wait_ready(timeout)
        return self

    def wait(self, op: str, key: str, want: object, timeout: float = RECOVER_S) -> float:
        """Seconds until the answer to op has key == want (AssertionError after timeout)."""
        t0 = time.monotonic()
        while (got := self(op=op))[key] != want:
            assert time.monotonic() - t0 < timeout, f"{self.name}: {op}.{key} still {got}"
            time.sleep(0.05)
        return time.monotonic() - t0


class Mesh:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.controller = ControllerProcess(tmp, snapshot=True)
        self.cacheserver = CacheServerProcess(tmp)
        self.a: Node | None = None
        self.b: Node | None = None
        self.totals = {"calls": 0, "faults": 0, "worst": 0.0}

    def start(self) -> Mesh:
        self.controller.launch()
        self.cacheserver.launch()
        self.controller.wait_ready(30)
        self.cacheserver.wait_ready(30)
        self.a = Node(self.tmp, "a", self.controller.url, self.cacheserver.url)
        self.b = Node(self.tmp, "b", self.controller.url, self.cacheserver.url)
        self.a.launch()
        self.b.launch()
        for node in self.nodes:
            node.up()
            node.wait("remote", "up", True)
            node.wait("registered", "registered", True)
        return self

    @property
    def nodes(self) -> list[Node]:
        return [n for n in (self.a, self.b) if n is not None and n.alive()]

    def traffic(self, **extra) -> None:
        assert self.a is not None and self.b is not None
        r = extra.get("round", 0)
        self.a(op="start", base=A_BASE + r, peer_base=B_BASE + r)
        self.b(op="start", base=B_BASE + r, peer_base=A_BASE + r)

    def stop_traffic(self, nodes: list[Node] | None = None) -> list[dict]:
        reports = [node(op="stop", timeout=60) for node in nodes or self.nodes]
        for r in reports:
            self.totals["calls"] += sum(r["calls"].values())
            self.totals["worst"] = max(self.totals["worst"], *r["worst"].values())
        return reports

    def check_clean(self) -> None:
        """No page held once everything is released; every service still running."""
        for node in self.nodes:
            got = node(op="release", timeout_s=10.0, timeout=30)
            assert got["flushed"] and got["pending"] == 0, (node.name, got)
            assert got["l1_chunks"] == 0, (node.name, got)
            assert got["free_pages"] == got["free_at_start"], (node.name, got)
        for proc in (self.controller, self.cacheserver, self.a, self.b):
            assert proc is not None and proc.alive(), proc.describe("is not running")

    def stop(self) -> dict[str, int | None]:
        """Every process asked to exit; their exit codes (0: a clean exit)."""
        codes = {node.name: node.stop() for node in self.nodes}
        codes["controller"] = self.controller.stop()
        codes["cacheserver"] = self.cacheserver.stop()
        return codes


def check(reports: list[dict], *, min_calls: int = 20) -> None:
    """No wrong KV, no failed or hung call, every call within its bound."""
    for r in reports:
        print(r["node"], r["calls"], r["hits"], {k: round(v, 3) for k, v in r["worst"].items()})
        assert not r["hung"], r
        assert r["n_wrong"] == 0, r["wrong"]
        assert r["n_errors"] == 0, r["errors"]
        assert r["n_late"] == 0, (r["late"], r["worst"])
        assert sum(r["calls"].values()) >= min_calls, r["calls"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    m = Mesh(tmp_path_factory.mktemp("mesh"))
    try:
        yield m.start()
    finally:
        print("mesh totals:", m.totals)
        codes = m.stop()
    # A process that crashed, hung or was left dead would not exit cleanly here.
    assert set(codes.values()) == {0}, codes


def remote_round_trip(node: Node, seeds: list[int]) -> dict:
    """Store seeds' prompts, then load them with the L1 copies dropped: the loads can
    only come from the remote (no peer holds these prompts)."""
    stored = node(op="store", seeds=seeds, flush=True)
    assert stored["stored"] == [64] * len(seeds), stored
    return node(op="retrieve", seeds=seeds, drop_l1=True)


def until_used_again(base: int, tier: str, round_trip: Callable[[list[int]], dict]) -> float:
    """Seconds until round_trip(seeds) of two new prompts loads both from tier (fresh
    seeds from base each try); never a wrong chunk meanwhile."""
    t0 = time.monotonic()
    attempt = 0
    while True:
        got = round_trip([base + 10 * attempt + i for i in range(2)])
        assert got["n_wrong"] == 0, got["wrong"]
        if got["loaded"] == [64, 64] and got["hits"][tier] == 128:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < RECOVER_S, f"the {tier} tier is not used again: {got}"
        attempt += 1
        time.sleep(0.1)


def wait_remote_used_again(mesh: Mesh, base: int) -> float:
    """Seconds until a new prompt of A's reaches the cache-server and comes back from it."""
    a = mesh.a
    assert a is not None
    return until_used_again(base, "remote", lambda seeds: remote_round_trip(a, seeds))


def test_cacheserver_killed_and_restarted_under_traffic(mesh: Mesh) -> None:
    assert mesh.a is not None and mesh.b is not None
    # Stored before the crash, which loses them with the server's memory.
    before = [3_200_000 + i for i in range(3)]
    assert remote_round_trip(mesh.a, before)["hits"]["remote"] == 64 * len(before)
    mesh.traffic(round=0)
    time.sleep(1.0)
    mesh.cacheserver.kill()
    mesh.totals["faults"] += 1
    for node in (mesh.a, mesh.b):
        node.wait("remote", "up", False, timeout=5.0)
    time.sleep(0.7)  # traffic goes on against a dead remote
    mesh.cacheserver.start(30)
    for node in (mesh.a, mesh.b):
        node.wait("remote", "up", True)
    time.sleep(0.5)
    check(mesh.stop_traffic())
    wait_remote_used_again(mesh, 3_000_000)
    # The same prompts come again (recomputed, stored again): the restarted server
    # must get them, as it has none of them. What the engine knew of the old server's
    # keys does not hold for the new one.
    again = remote_round_trip(mesh.a, before)
    assert again["n_wrong"] == 0, again["wrong"]
    assert again["loaded"] == [64] * len(before), again
    assert again["hits"]["remote"] == 64 * len(before), again
    mesh.check_clean()


def test_cacheserver_frozen_past_the_deadline(mesh: Mesh) -> None:
    assert mesh.a is not None and mesh.b is not None and mesh.cacheserver.proc is not None
    mesh.traffic(round=10_000)
    time.sleep(1.0)
    mesh.cacheserver.proc.send_signal(signal.SIGSTOP)
    mesh.totals["faults"] += 1
    try:
        time.sleep(3 * DEADLINE_S)
        for node in (mesh.a, mesh.b):
            node.wait("remote", "up", False, timeout=5.0)
    finally:
        mesh.cacheserver.proc.send_signal(signal.SIGCONT)
    for node in (mesh.a, mesh.b):
        node.wait("remote", "up", True)
    time.sleep(0.5)
    check(mesh.stop_traffic())
    wait_remote_used_again(mesh, 3_100_000)
    mesh.check_clean()


def wait_p2p_used_again(mesh: Mesh, base: int) -> float:
    """Seconds until a prompt A stores now is read by B from A's L1 (the controller
    names A again)."""
    a, b = mesh.a, mesh.b
    assert a is not None and b is not None

    def round_trip(seeds: list[int]) -> dict:
        stored = a(op="store", seeds=seeds, flush=True)
        assert stored["stored"] == [64, 64], stored
        time.sleep(0.1)  # past A's event flush period
        return b(op="retrieve", seeds=seeds)

    return until_used_again(base, "p2p", round_trip)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_controller_fault_under_traffic(mesh: Mesh, fault: str) -> None:
    assert mesh.a is not None and mesh.b is not None and mesh.controller.proc is not None
    wait_p2p_used_again(mesh, 4_000_000 + (0 if fault == "kill" else 500_000))
    mesh.traffic(round=20_000 if fault == "kill" else 30_000)
    time.sleep(1.0)
    mesh.totals["faults"] += 1
    if fault == "kill":
        mesh.controller.kill()
        time.sleep(1.0)
        mesh.controller.start(30)
    else:
        mesh.controller.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.5)
        finally:
            mesh.controller.proc.send_signal(signal.SIGCONT)
    time.sleep(0.5)
    check(mesh.stop_traffic())
    for node in (mesh.a, mesh.b):
        node.wait("registered", "registered", True)
    wait_p2p_used_again(mesh, 4_100_000 + (0 if fault == "kill" else 500_000))
    mesh.check_clean()


def test_peer_frozen_mid_p2p_get(mesh: Mesh) -> None:
    """B keeps reading A's chunks from A's L1; A is frozen past the deadline, then
    thawed: its late answers to reads B gave up on must never land as another read's
    KV, and once A is back (re-registered if the controller dropped it) B reads from
    it again."""
    assert mesh.a is not None and mesh.b is not None and mesh.a.proc is not None
    seeds = [4_900_000 + i for i in range(12)]
    stored = mesh.a(op="store", seeds=seeds, flush=True)
    assert stored["stored"] == [64] * len(seeds), stored
    time.sleep(0.2)  # A's admits reach the controller
    mesh.b(op="start", base=B_BASE + 35_000, peer_seeds=seeds)
    time.sleep(1.0)
    mesh.a.proc.send_signal(signal.SIGSTOP)
    mesh.totals["faults"] += 1
    try:
        time.sleep(3 * DEADLINE_S)
    finally:
        mesh.a.proc.send_signal(signal.SIGCONT)
    time.sleep(1.0)  # reads of A's chunks go on while A catches up
    [report] = mesh.stop_traffic([mesh.b])
    check([report])
    assert report["hits"]["p2p"] > 0, report
    mesh.a.wait("registered", "registered", True)
    wait_p2p_used_again(mesh, 4_950_000)
    mesh.check_clean()


def test_peer_killed_mid_p2p_get(mesh: Mesh) -> None:
    """B keeps reading A's chunks from A's L1; A is killed mid-read. B's reads miss
    (or come from the remote, where A put them) within the deadline, never wrong."""
    assert mesh.a is not None and mesh.b is not None
    seeds = [5_000_000 + i for i in range(12)]
    stored = mesh.a(op="store", seeds=seeds, flush=True)
    assert stored["stored"] == [64] * len(seeds), stored
    time.sleep(0.2)  # A's admits reach the controller
    mesh.b(op="start", base=B_BASE + 40_000, peer_seeds=seeds)
    time.sleep(1.0)
    mesh.a.kill()
    mesh.totals["faults"] += 1
    time.sleep(1.5)
    [report] = mesh.stop_traffic([mesh.b])
    check([report])
    # Once the controller dropped A, B finds A's prompts in the remote tier.
    t0 = time.monotonic()
    while True:
        got = mesh.b(op="retrieve", seeds=seeds[:4], drop_l1=True)
        assert got["n_wrong"] == 0, got["wrong"]
        if got["loaded"] == [64] * 4 and got["hits"]["remote"] == 256:
            break
        assert time.monotonic() - t0 < RECOVER_S, got
        time.sleep(0.1)
    mesh.a = None  # killed on purpose: not among the processes that must be running
    for node in mesh.nodes:
        got = node(op="release", timeout_s=10.0, timeout=30)
        assert got["free_pages"] == got["free_at_start"] and got["l1_chunks"] == 0, got
    for proc in (mesh.controller, mesh.cacheserver, mesh.b):
        assert proc.alive(), proc.describe("is not running")


def stored_again_is_read_from_the_remote(eng, remote, prompt: list[int], slots) -> None:
    """After the remote restarted empty: the prompt stored again (L1 cleared, so it is
    stored, not found) reaches the remote, and a retrieve with L1 cleared loads all of
    it from there."""
    eng.clear(prompt, tier="l1")
    assert eng.store(prompt, slots) == len(prompt) and remote.flush(5)
    eng.clear(prompt, tier="l1")
    assert int(eng.retrieve(prompt, slots).sum()) == len(prompt)
    assert eng.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == len(prompt)


@contextlib.contextmanager
def stored_prompt(
    url: str, instance: str, first: int, **remote: object
) -> Iterator[tuple[Any, Any, list[int], torch.Tensor]]:
    """An engine over the remote at url that has stored a 64-token prompt there:
    (engine, its remote tier, prompt, slots), closed at the end. Presence entries live
    600 s, so only the tier forgetting them can make it store the prompt again."""
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=64)
    eng = remote_engine(url, view, instance=instance, presence_ttl_s=600.0, **remote)
    try:
        tier = eng.storage.tier("remote")
        prompt, slots = list(range(first, first + 64)), torch.arange(64)
        assert eng.store(prompt, slots) == 64 and tier.flush(5)
        yield eng, tier, prompt, slots
    finally:
        eng.close()


def test_a_restart_quicker_than_the_health_check_is_still_seen(tmp_path: Path) -> None:
    """The cache-server is killed and back before the health monitor's next ping (and
    no request came meanwhile), so the tier never saw it down. Its lost connection
    still tells it that what it knew of the server's keys is gone: a chunk stored
    again reaches the new server instead of being skipped as already there."""
    with (
        CacheServerProcess(tmp_path) as srv,
        stored_prompt(srv.url, "quick", 9_000_000, health_interval_s=30.0) as stored,
    ):
        eng, remote, prompt, slots = stored
        srv.kill()
        srv.start()
        wait_for(lambda: remote.connector.connected(), 10.0, "a new connection")
        assert remote.up, "the restart was noticed by the monitor: not the case tested"
        stored_again_is_read_from_the_remote(eng, remote, prompt, slots)


def test_a_restarted_redis_gets_chunks_stored_again(tmp_path: Path) -> None:
    """Redis without persistence restarts empty. The tier saw it down; once it is up
    again, a chunk stored again must reach it rather than be skipped as already there
    (the tier's memory of present keys was of the old process), also when the store
    comes the moment the tier is seen up."""
    redis = RedisProcess(tmp_path).start()
    try:
        with stored_prompt(redis.url, "redis-restart", 9_100_000) as stored:
            eng, remote, prompt, slots = stored
            forget = remote.presence.clear

            def forget_slowly() -> None:
                # A loaded machine's thread switch between the tier seen up and its old
                # keys forgotten, made long enough that a store always falls in it.
                time.sleep(0.3)
                forget()

            remote.presence.clear = forget_slowly
            redis.kill()
            wait_for(lambda: not remote.up, 10.0, "the remote seen down")
            redis.start()
            assert remote.wait_ready(10.0)
            stored_again_is_read_from_the_remote(eng, remote, prompt, slots)
    finally:
        redis.kill()


def test_a_redis_restart_between_health_checks_is_seen_at_its_first_failed_request(
    tmp_path: Path,
) -> None:
    """No health check between Redis's restart and the next requests: redis-py's pooled
    connection fails once, and that failure must make the tier forget the keys of the
    old process (else the prompt stored again is dropped as already there)."""
    redis = RedisProcess(tmp_path).start()
    try:
        # Its failed gets must not mark it down (then the stores again would be dropped
        # as "down" until a health check 30 s later): what is tested is what they forget.
        quiet = {"health_interval_s": 30.0, "failures_to_down": 1000}
        with stored_prompt(redis.url, "redis-quick", 9_200_000, **quiet) as stored:
            eng, remote, prompt, slots = stored
            redis.kill()
            redis.start()
            eng.clear(prompt, tier="l1")
            # The first gets meet the dead connection: misses, and the store noticed.
            assert int(eng.retrieve(prompt, slots).sum()) == 0
            stored_again_is_read_from_the_remote(eng, remote, prompt, slots)
    finally:
        redis.kill()
