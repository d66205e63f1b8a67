"""TenantDatabases: one key namespace per tenant, at most `max_dbs` kept."""

from __future__ import annotations

import pytest

from kvmesh.common.keys import KeyNamespace
from kvmesh.common.tokendb import ChunkedTokenDatabase
from kvmesh.services.worker.tenants import MAX_TENANT_DBS, TenantDatabases


def base_db() -> ChunkedTokenDatabase:
    ns = KeyNamespace(model="m", kv_layout="kv", dtype="float16", world_size=1, rank=0, tenant="")
    return ChunkedTokenDatabase(ns, chunk_size=4)


def keys(db: ChunkedTokenDatabase) -> list:
    return [key for _, _, key in db.process_tokens(list(range(8)))]


def test_tenant_databases_are_bounded_and_least_recently_used_go_first() -> None:
    dbs = TenantDatabases(base_db(), max_dbs=3)
    a = dbs.get("a")
    dbs.get("b")
    dbs.get("c")
    assert dbs.get("a") is a  # used again: now the most recent
    dbs.get("d")  # drops b, the least recently used
    assert len(dbs) == 4  # the engine's own database and three tenants
    assert dbs.get("a") is a
    for i in range(100):  # a client rotating tenant strings
        dbs.get(f"user-{i}")
    assert len(dbs) == 4
    assert dbs.get("") is dbs.base


def test_a_rebuilt_tenant_database_gives_the_same_keys() -> None:
    dbs = TenantDatabases(base_db(), max_dbs=1)
    first = keys(dbs.get("a"))
    dbs.get("b")  # a is dropped
    assert keys(dbs.get("a")) == first
    assert first != keys(dbs.get("b")) and first != keys(dbs.get(""))


def test_the_default_bound() -> None:
    dbs = TenantDatabases(base_db())
    for i in range(MAX_TENANT_DBS + 10):
        dbs.get(f"t{i}")
    assert len(dbs) == MAX_TENANT_DBS + 1


def test_bad_tenants_are_refused() -> None:
    dbs = TenantDatabases(base_db())
    with pytest.raises(ValueError, match="printable"):
        dbs.get("a\x00b")
    with pytest.raises(TypeError):
        dbs.get(None)  # type: ignore[arg-type]
    assert len(dbs) == 1
