"""Per-request tenants on top of an engine salt: no (salt, tenant) pair shares a
namespace with another engine's salt. The combined salt joins the two with a NUL,
which a checked tenant never holds; an engine salt holding one is refused, since
engine salt "a" with tenant "b" would otherwise read engine salt "a\\0b"'s chunks."""

from __future__ import annotations

import pytest

from kvmesh.common.keys import KeyNamespace
from kvmesh.common.tokendb import ChunkedTokenDatabase
from kvmesh.services.worker.tenants import TenantDatabases


def tenants(salt: str) -> TenantDatabases:
    ns = KeyNamespace(model="m", kv_layout="l", dtype="d", world_size=1, rank=0, tenant=salt)
    return TenantDatabases(ChunkedTokenDatabase(ns, chunk_size=4))


def test_no_salt_and_tenant_pair_reaches_a_salt_with_a_nul() -> None:
    """Engine salt "a" with request tenant "b" is "a\\0b" inside: an engine salted
    "a\\0b" (the config takes any string) is refused rather than shared."""
    reached = tenants("a").get("b").namespace.ns_id
    try:
        victim = tenants("a\x00b").get("").namespace.ns_id
    except ValueError as exc:
        assert "tenant_salt" in str(exc)
        return
    assert reached != victim


@pytest.mark.parametrize(
    ("salt", "tenant"),
    [("", "t"), ("s", "t"), ("s", "t s"), ("s t", "u"), ("é", "e\u0301"), ("s", "a" * 255)],
)
def test_distinct_pairs_get_distinct_namespaces(salt: str, tenant: str) -> None:
    seen = {
        tenants(salt).get(tenant).namespace.ns_id,
        tenants(salt).get("").namespace.ns_id,
        tenants(salt + "\x01").get(tenant).namespace.ns_id,
        tenants(salt).get(tenant + "x").namespace.ns_id,
    }
    assert len(seen) == 4


def test_a_request_tenant_is_never_an_engine_salt() -> None:
    """A client of an unsalted engine naming tenant "x" must not read the chunks of a
    deployment whose engines are salted "x"."""
    assert tenants("").get("x").namespace.ns_id != tenants("x").get("").namespace.ns_id
