"""Tenant isolation across the mesh: real engines (in this process) wired to a real
controller, lookup-server and cache-server, each engine with L1, the P2P tier (through
the controller's registry), the kvmesh:// remote tier and a lookup endpoint.

Two kinds of tenant, both checked: a per-request tenant (the vLLM connector's
`kv_transfer_params.tenant`) on engines without a salt, and an engine `tenant_salt`
(one deployment per tenant). Two tenants storing the same prompt get different keys;
neither sees a hit of the other's chunks through any path: the engine's lookup and
retrieve (L1, P2P, remote), the lookup-server's Lookup and BestInstances, the
controller's PrefixCounts and P2PLookup, and its KV-event feed by namespace. Each
negative has a positive control beside it (the owner, or the infrastructure view, does
see the chunks), so a 0 means "isolated", not "broken". Admin outputs name counts and
namespaces, not tenants or prompts; clearing one tenant's prompt leaves the other's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from click.testing import CliRunner
from kvtest.controller import ControllerProcess, tokens
from kvtest.paged import make_cache
from kvtest.remote import CacheServerProcess
from kvtest.service_process import KvmeshService, free_port
from kvtest.waiting import wait_for

from kvmesh.common.config import EngineConfig, EngineControllerConfig, L1Config
from kvmesh.common.config.schema import P2PConfig, RemoteConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.protocol import controller as cproto
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.common.transport.kv_events_client import Delivery, KvEventsSubscriber
from kvmesh.common.transport.lookup_service_client import (
    LookupServiceClient,
    LookupServiceError,
)
from kvmesh.services.cli.main import cli
from kvmesh.services.worker import controller_client as cc
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.lookup_server import attach_lookup_server

CHUNK = 8
N = 32  # 4 chunks
BLOCKS, BLOCK = 16, 4  # 64 slots


def engine_config(controller_url: str, remote_url: str, salt: str) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="isolation",
        tenant_salt=salt,
        close_flush_s=0,
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        controller=EngineControllerConfig(
            enabled=True, url=controller_url, heartbeat_s=0.2, timeout_s=1.0, event_flush_s=0.02
        ),
        # Generous lookup deadlines: the positive controls must not miss on a busy box.
        p2p=P2PConfig(enabled=True, channel="zmq", timeout_s=2.0, lookup_timeout_s=1.0),
        # No presence cache: every contains asks the cache-server.
        remote=RemoteConfig(
            enabled=True,
            url=remote_url,
            timeout_s=2.0,
            lookup_timeout_s=1.0,
            health_interval_s=0.1,
            presence_ttl_s=0,
            absence_ttl_s=0,
        ),
    )


def make_engine(instance: str, controller: ControllerProcess, cache: CacheServerProcess,
                salt: str = "") -> KVEngine:  # fmt: skip
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = KVEngine(instance, 0, engine_config(controller.url, cache.url, salt), view)
    try:
        attach_lookup_server(eng, f"tcp://127.0.0.1:{free_port()}")
        assert eng.storage.tier("remote").wait_ready(10), "remote tier not ready"
        assert cc.wait_registered(eng.controller_client, 10.0), "engine did not register"
    except BaseException:
        eng.close()
        raise
    return eng


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The services, and four engines: a and b without a salt (per-request tenants),
    s1 and s2 with engine tenant salts "t1" and "t2"."""
    tmp = tmp_path_factory.mktemp("tenants")
    controller = ControllerProcess(tmp, snapshot=False)
    events_port, replay_port = free_port(), free_port()
    controller.env["KVMESH_CONTROLLER__EVENTS_PORT"] = str(events_port)
    controller.env["KVMESH_CONTROLLER__EVENTS_REPLAY_PORT"] = str(replay_port)
    controller.start()
    procs: list[Any] = [controller]
    engines: dict[str, KVEngine] = {}
    try:
        cache = CacheServerProcess(tmp).start(60)
        procs.append(cache)
        lookup = KvmeshService(
            "lookup",
            tmp,
            free_port(),
            {"controller-url": controller.url, "chunk-size": CHUNK, "worker-timeout-s": 2.0},
        ).start(60)
        procs.append(lookup)
        for name, salt in (("a", ""), ("b", ""), ("s1", "t1"), ("s2", "t2")):
            engines[name] = make_engine(f"iso-{name}", controller, cache, salt)
        lookup_url = f"tcp://127.0.0.1:{lookup.port}"

        def all_answer() -> bool:
            # An engine registers before its lookup endpoint is bound, then again with
            # it: until the lookup-server knows every endpoint, its lookups are -1.
            async def fn(c: LookupServiceClient) -> bool:
                replies = [await c.lookup(f"iso-{n}", [1] * N, pin=False) for n in engines]
                return all(r.per_rank == [0] for r in replies)

            try:
                return lookup_service(lookup_url, fn)
            except LookupServiceError:  # an instance not known yet
                return False

        wait_for(all_answer, 20, "the lookup-server to reach every engine")
        yield {
            "controller": controller,
            "cache": cache,
            "lookup_url": lookup_url,
            "events_url": f"tcp://127.0.0.1:{events_port}",
            "replay_url": f"tcp://127.0.0.1:{replay_port}",
            **engines,
        }
    finally:
        for eng in engines.values():
            eng.close()
        for p in reversed(procs):
            p.stop()


# -- helpers ------------------------------------------------------------------------------


def keys_of(eng: KVEngine, prompt: list[int], tenant: str = "") -> list[ChunkKey]:
    return [key for _, _, key in eng.chunks(prompt, tenant=tenant)]


def store(eng: KVEngine, prompt: list[int], tenant: str = "") -> list[ChunkKey]:
    """Store prompt for tenant, wait until the remote holds it and the controller
    has it in the engine's L1; the chunk keys."""
    assert eng.store(prompt, torch.arange(N), tenant=tenant) == N
    assert eng.storage.tier("remote").flush(10)
    keys = keys_of(eng, prompt, tenant)
    wait_for(lambda: p2p_lookup(eng, keys).count == len(keys), 10, "the controller to learn")
    return keys


def retrieved(eng: KVEngine, prompt: list[int], tenant: str = "") -> int:
    slots = torch.arange(BLOCKS * BLOCK - N, BLOCKS * BLOCK)  # not the slots stored from
    return int(eng.retrieve(prompt, slots, tenant=tenant).sum())


def remote_holds(eng: KVEngine, keys: list[ChunkKey]) -> int:
    return eng.storage.tier("remote").batched_contains(keys)


def peer_holds(eng: KVEngine, keys: list[ChunkKey]) -> int:
    """What eng's P2P tier finds at a peer (the controller locates, excluding eng)."""
    return eng.storage.tier("p2p").batched_contains(keys)


def controller_call(url: str, build: Any, expect: type) -> Any:
    async def main() -> Any:
        conn = ControllerConnection(url, timeout_s=5.0, client="test")
        try:
            await conn.connect()
            return await conn.request(build(conn.next_rid()), expect)
        finally:
            await conn.close()

    return asyncio.run(main())


def p2p_lookup(eng: KVEngine, keys: list[ChunkKey]) -> cproto.P2PLookupReply:
    url = eng.config.controller.url
    strs = [k.to_str() for k in keys]
    return controller_call(url, lambda r: cproto.P2PLookup(r, strs), cproto.P2PLookupReply)


def prefix_counts(url: str, prompt: list[int], eng: KVEngine) -> dict[str, int]:
    hashes = eng.tokendb.chunk_hashes(prompt)
    reply = controller_call(url, lambda r: cproto.PrefixCounts(r, hashes), cproto.PrefixCountsReply)
    return {c.instance_id: c.chunks for c in reply.instances}


def lookup_service(url: str, fn: Any) -> Any:
    async def main() -> Any:
        async with LookupServiceClient(url, timeout_s=5.0, name="test") as client:
            return await fn(client)

    return asyncio.run(main())


def ls_lookup(mesh: dict[str, Any], instance: str, prompt: list[int], tenant: str = "") -> int:
    reply = lookup_service(
        mesh["lookup_url"], lambda c: c.lookup(instance, prompt, pin=False, tenant=tenant)
    )
    # -1: the rank was not asked or did not answer; a 0 must be the worker's own.
    assert reply.per_rank == [reply.hit_tokens], reply
    return reply.hit_tokens


def best(mesh: dict[str, Any], prompt: list[int]) -> dict[str, int]:
    found = lookup_service(mesh["lookup_url"], lambda c: c.best_instances(prompt))
    return {h.instance_id: h.hit_tokens for h in found}


# -- per-request tenants ------------------------------------------------------------------


def test_per_request_tenants_never_see_each_others_chunks(mesh) -> None:
    a, b = mesh["a"], mesh["b"]
    prompt = tokens(N, 101)
    alice = store(a, prompt, "alice")

    # The same prompt, other tenants (and no tenant): other keys, whichever engine.
    bob = keys_of(b, prompt, "bob")
    plain = keys_of(a, prompt)
    assert not set(alice) & set(bob) and not set(alice) & set(plain)
    assert {k.namespace_id for k in alice}.isdisjoint({k.namespace_id for k in bob + plain})
    assert keys_of(b, prompt, "alice") == alice  # a tenant is the same on every engine

    for eng, tenant in ((a, "bob"), (a, ""), (b, "bob"), (b, "")):
        assert eng.lookup(prompt, tenant=tenant) == 0, (eng.instance_id, tenant)
        assert retrieved(eng, prompt, tenant) == 0, (eng.instance_id, tenant)
    # Each tier on its own: a's L1, the remote, a's L1 seen from b as a peer.
    assert a.storage.l1.batched_contains(bob) == 0 and a.storage.l1.batched_contains(alice) == 4
    assert remote_holds(b, bob) == 0 and remote_holds(b, alice) == 4
    assert peer_holds(b, bob) == 0 and peer_holds(b, alice) == 4
    assert p2p_lookup(b, bob).count == 0 and p2p_lookup(b, alice).endpoint == a.p2p_endpoint

    # The lookup-server asks a's workers with the request's tenant.
    assert ls_lookup(mesh, "iso-a", prompt, "bob") == 0
    assert ls_lookup(mesh, "iso-a", prompt) == 0
    assert ls_lookup(mesh, "iso-a", prompt, "alice") == N
    # Registry views (BestInstances, PrefixCounts) count only the engines' own
    # namespaces: a per-request tenant's chunks never show there, for anyone.
    assert not any(best(mesh, prompt).values())
    assert not any(prefix_counts(mesh["controller"].url, prompt, a).values())

    # Positive: alice on b reads her chunks (from a's L1 over P2P, or the remote).
    assert b.lookup(prompt, tenant="alice") == N
    assert retrieved(b, prompt, "alice") == N


def test_a_tenant_lookup_by_hashes_is_refused(mesh) -> None:
    """Hashes carry no tenant: a registry answer would count the engines' own
    namespaces, i.e. requests without a tenant. A tenant's lookup by hashes is refused
    rather than answered with another tenant's hits."""
    a = mesh["a"]
    prompt = tokens(N, 102)
    store(a, prompt)  # no tenant: in the registry under a's namespace
    hashes = a.tokendb.chunk_hashes(prompt)

    def by_hashes(tenant: str) -> Any:
        async def fn(c: LookupServiceClient) -> Any:
            try:
                return await c.lookup("iso-a", hashes=hashes, pin=False, tenant=tenant)
            except LookupServiceError as exc:
                return exc

        return lookup_service(mesh["lookup_url"], fn)

    wait_for(lambda: getattr(by_hashes(""), "hit_tokens", 0) == N, 10, "the registry to count")
    refused = by_hashes("bob")
    assert isinstance(refused, LookupServiceError), refused
    assert "tenant" in str(refused)
    assert ls_lookup(mesh, "iso-a", prompt, "bob") == 0  # by tokens: asked, and 0


def test_two_tenants_storing_the_same_prompt_and_clearing_one(mesh) -> None:
    a, b = mesh["a"], mesh["b"]
    prompt = tokens(N, 103)
    alice = store(a, prompt, "alice")
    bob = store(b, prompt, "bob")
    assert not set(alice) & set(bob)
    assert remote_holds(a, alice + bob) == 8  # both copies, side by side
    assert a.lookup(prompt, tenant="alice") == N and b.lookup(prompt, tenant="bob") == N
    assert a.lookup(prompt, tenant="carol") == b.lookup(prompt, tenant="carol") == 0

    # Clearing alice's prompt (her L1 copy and the remote one) leaves bob's.
    assert a.clear(prompt, tenant="alice") == 8
    assert remote_holds(a, alice) == 0 and remote_holds(a, bob) == 4
    wait_for(lambda: p2p_lookup(b, alice).count == 0, 10, "the controller to drop alice's")
    assert a.lookup(prompt, tenant="alice") == b.lookup(prompt, tenant="alice") == 0
    assert b.lookup(prompt, tenant="bob") == N and a.lookup(prompt, tenant="bob") == N


def test_kv_event_feed_topics_are_namespaces_not_tenants(mesh) -> None:
    """The controller's KV-event feed: a consumer subscribed to bob's namespace gets
    bob's chunks and never alice's; the unfiltered feed carries both under their own
    namespace ids and no tenant name. The chunk hashes of the same prompt are equal:
    the namespace (key prefix and topic) is what tells the tenants apart."""
    a, b = mesh["a"], mesh["b"]
    prompt = tokens(N, 106)
    alice = {k.to_str() for k in keys_of(a, prompt, "alice")}
    bob = {k.to_str() for k in keys_of(b, prompt, "bob")}
    alice_ns, bob_ns = {k[:16] for k in alice}, {k[:16] for k in bob}
    assert len(alice_ns) == len(bob_ns) == 1 and alice_ns != bob_ns
    assert {k[17:] for k in alice} == {k[17:] for k in bob}

    def stored(items: list[Delivery]) -> dict[str, str]:
        """key -> the topic it came under, of every stored event so far."""
        return {
            e.key: d.topic
            for d in items
            for e in getattr(d.payload, "events", [])
            if e.op == "stored"
        }

    async def main() -> tuple[list[Delivery], list[Delivery]]:
        everything: list[Delivery] = []
        bobs: list[Delivery] = []
        changed = asyncio.Event()

        async def pump(sub: KvEventsSubscriber, out: list[Delivery]) -> None:
            async for item in sub:
                assert isinstance(item, Delivery), item  # nothing lost on loopback
                out.append(item)
                changed.set()

        async def seen(keys: set[str], *lists: list[Delivery], limit_s: float = 10.0) -> bool:
            """Whether every key was stored in each list's events within limit_s."""
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit_s):
                    while not all(keys <= stored(x).keys() for x in lists):
                        changed.clear()
                        await changed.wait()
                    return True
            return False

        url, replay = mesh["events_url"], mesh["replay_url"]
        async with (
            KvEventsSubscriber(url, replay) as sub_all,
            KvEventsSubscriber(url, replay, namespaces=sorted(bob_ns)) as sub_bob,
        ):
            tasks = [
                asyncio.create_task(pump(sub_all, everything)),
                asyncio.create_task(pump(sub_bob, bobs)),
            ]
            try:
                # The feed publishes only while someone listens: warm-up stores of new
                # prompts until one reaches both subscribers.
                for seed in range(200, 230):
                    warm = await asyncio.to_thread(store, b, tokens(N, seed), "bob")
                    if await seen({k.to_str() for k in warm}, bobs, everything, limit_s=1.0):
                        break
                else:
                    raise AssertionError("the KV-event feed never published")
                await asyncio.to_thread(store, a, prompt, "alice")
                await asyncio.to_thread(store, b, prompt, "bob")
                assert await seen(alice | bob, everything), "both tenants' chunks on the feed"
                assert await seen(bob, bobs), "bob's chunks on bob's subscription"
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return everything, bobs

    everything, bobs = asyncio.run(main())
    seen_all, seen_bob = stored(everything), stored(bobs)
    assert not alice & seen_bob.keys()  # bob's subscriber never hears of alice's chunks
    assert set(seen_bob.values()) <= bob_ns
    assert {seen_all[k] for k in alice} == alice_ns and {seen_all[k] for k in bob} == bob_ns
    for d in everything:
        raw = msgspec.msgpack.encode(d.payload)
        assert b"alice" not in raw and b"bob" not in raw


# -- engine tenant salts ------------------------------------------------------------------


def test_engine_tenant_salts_isolate_deployments(mesh) -> None:
    s1, s2, a = mesh["s1"], mesh["s2"], mesh["a"]
    prompt = tokens(N, 104)
    t1 = store(s1, prompt)
    t2 = keys_of(s2, prompt)
    assert s1.namespace.ns_id != s2.namespace.ns_id != a.namespace.ns_id
    assert not set(t1) & set(t2) and not set(t1) & set(keys_of(a, prompt))
    # A per-request tenant on top of a salt is yet another namespace.
    assert not set(keys_of(s1, prompt, "alice")) & set(keys_of(a, prompt, "alice"))

    for eng in (s2, a):
        assert eng.lookup(prompt) == 0 and retrieved(eng, prompt) == 0, eng.instance_id
        assert peer_holds(eng, keys_of(eng, prompt)) == 0
        assert remote_holds(eng, keys_of(eng, prompt)) == 0
    assert s1.lookup(prompt, tenant="alice") == 0
    assert peer_holds(s2, t1) == 4 and remote_holds(s2, t1) == 4  # s1's, by its own keys

    assert ls_lookup(mesh, "iso-s2", prompt) == 0
    assert ls_lookup(mesh, "iso-s1", prompt) == N
    # The registry view is per instance, in each instance's own namespace: s1 holds
    # the prompt, s2 (tenant t2) and a (no salt) hold none of it.
    counts = wait_for(
        lambda: (c := prefix_counts(mesh["controller"].url, prompt, s1)).get("iso-s1") and c,
        10,
        "the registry to count s1's chunks",
    )
    assert counts == {"iso-s1": 4} | {k: 0 for k in counts if k != "iso-s1"}
    # BestInstances is answered from the lookup-server's copy of the registry, which
    # the controller's pushes reach after the controller itself counts the chunks.
    hits = wait_for(
        lambda: (h := best(mesh, prompt)).get("iso-s1") == N and h,
        10,
        "the lookup-server's index to count s1's chunks",
    )
    assert not hits.get("iso-s2") and not hits.get("iso-a")


# -- admin outputs ------------------------------------------------------------------------


def test_admin_outputs_name_counts_not_tenants_or_prompts(mesh) -> None:
    a = mesh["a"]
    prompt = tokens(N, 105)
    secret = "tenant-zebra"
    keys = store(a, prompt, secret)
    url = mesh["controller"].url
    outputs = []
    for args in (["workers"], ["instances"], ["health"], ["--json", "workers"],
                 ["--json", "health"]):  # fmt: skip
        out = CliRunner().invoke(cli, ["admin", "--url", url, "--timeout", "5", *args])
        assert out.exit_code == 0, out.output
        outputs.append(out.output)
    out = CliRunner().invoke(
        cli, ["status", "--json", "--timeout", "5", "--controller", url,
              "--lookup-url", mesh["lookup_url"], "--cacheserver-url", mesh["cache"].endpoint],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    outputs.append(out.output)
    view = json.loads(out.output)
    assert any(i["instance_id"] == "iso-a" for i in view["instances"])

    text = "\n".join(outputs)
    assert "iso-a" in text  # the outputs are about the mesh ...
    assert secret not in text  # ... and never name a tenant
    for key in keys:  # nor a chunk, nor its hash
        assert key.to_str() not in text and key.chunk_hash.hex() not in text
    assert " ".join(map(str, prompt[:4])) not in text and str(prompt[:4])[1:-1] not in text
