"""What the connector reads from vLLM: `kv_connector_extra_config` and per-request
`kv_transfer_params`, both decoded into typed Structs that reject unknown keys.

kv_connector_extra_config (every key optional):

    config            the kvmesh configuration as a dict ({"engine": {...}, ...})
    config_path       a kvmesh YAML file; with `config` too, `config` overrides it
    instance_id       names this vLLM instance's engines (default: vLLM's engine id,
                      plus "-dp<rank>" under data parallelism)
    lookup_timeout_s  the scheduler's deadline for asking the workers (default 0.5)

With `config` alone the dict is the whole configuration (no file, no environment);
with `config_path`, or with neither, the usual layers apply (defaults < file or
$KVMESH_CONFIG < KVMESH_* environment < `config`).

kv_transfer_params of a request may carry `{"kvmesh": {...}}`:

    skip_save   bool  do not store this request's KV
    skip_load   bool  do not look up or load cached KV for it
    tenant      str   a tenant salt: its chunks are shared only with requests of the
                      same tenant (and the same vLLM cache_salt, see with_cache_salt)
    pd          {"transfer_id": str, "endpoints": [str]}   disaggregated prefill (set
                      by the bridge): with endpoints, push this prompt's KV to that
                      decoder; without, the KV of that transfer was pushed here

A request whose kvmesh params do not decode is served without the cache (neither
loaded nor saved): a typo in a tenant name must not leak another tenant's KV.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvmesh.common.config import ConfigError, KvmeshConfig, config_from_dict, load_config
from kvmesh.common.config.fields import close_match
from kvmesh.services.worker.tenants import check_tenant

EXTRA_CONFIG_SOURCE = "kv_connector_extra_config"


class ConnectorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    config: dict[str, Any] | None = None
    config_path: str | None = None
    instance_id: str | None = None
    lookup_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.5


class PdParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Disaggregated prefill, as the bridge sets it: on the prefill request, where to
    push the KV (the decoder's P2P endpoint per rank); on the decode request, the
    transfer alone (its chunks are pinned on the decoder until the request ends)."""

    transfer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\w.-]+$")]
    endpoints: Annotated[
        list[Annotated[str, msgspec.Meta(pattern=r"^tcp://[^\s]+:\d+$")]],
        msgspec.Meta(max_length=64),
    ] = []


class RequestOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    skip_save: bool = False
    skip_load: bool = False
    tenant: str = ""
    pd: PdParams | None = None

    def __post_init__(self) -> None:
        check_tenant(self.tenant)


DEFAULT_REQUEST = RequestOptions()
# Starts the tenant kvmesh derives from a request's vLLM cache_salt (with_cache_salt);
# a request's own tenant may not start with it, so the two can never meet.
SALTED = "\u241f"
# A request that must not touch the cache at all (its params were malformed).
NO_CACHE = RequestOptions(skip_save=True, skip_load=True)


def parse_extra_config(extra: Mapping[str, Any] | None) -> tuple[ConnectorOptions, KvmeshConfig]:
    """The connector's options and the kvmesh config; ValueError naming the bad key."""
    extra = dict(extra or {})
    known = ConnectorOptions.__struct_fields__
    for key in extra:
        if key not in known:
            near = close_match(str(key), list(known))
            hint = f"; did you mean {near!r}?" if near else f"; known keys: {', '.join(known)}"
            raise ValueError(f"{EXTRA_CONFIG_SOURCE}: unknown key {key!r}{hint}")
    try:
        options = msgspec.convert(extra, ConnectorOptions)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{EXTRA_CONFIG_SOURCE}: {exc}") from None
    return options, _kvmesh_config(options)


def _kvmesh_config(options: ConnectorOptions) -> KvmeshConfig:
    try:
        if options.config is not None and options.config_path is None:
            return config_from_dict(options.config, source=EXTRA_CONFIG_SOURCE)
        if options.config_path is not None and not os.path.isfile(options.config_path):
            raise ValueError(
                f"{EXTRA_CONFIG_SOURCE}: config_path {options.config_path!r} is not a file"
            )
        return load_config(
            options.config_path,
            overrides=options.config,
            overrides_label=EXTRA_CONFIG_SOURCE,
        )
    except ConfigError as exc:
        # The message lists every bad key with where it was set.
        raise ValueError(f"invalid kvmesh configuration: {exc}") from None


def parse_request_options(params: Mapping[str, Any] | None) -> tuple[RequestOptions, str | None]:
    """A request's kvmesh options, and the problem when they are malformed (the
    options are then NO_CACHE)."""
    if not params or "kvmesh" not in params:
        return DEFAULT_REQUEST, None
    raw = params["kvmesh"]
    try:
        options = msgspec.convert(raw, RequestOptions)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        return NO_CACHE, f"kv_transfer_params.kvmesh: {exc}"
    if options.tenant.startswith(SALTED):
        return NO_CACHE, f"kv_transfer_params.kvmesh.tenant: may not start with {SALTED!r}"
    return options, None


def with_cache_salt(options: RequestOptions, cache_salt: str | None) -> RequestOptions:
    """vLLM's cache_salt isolates kvmesh as it isolates vLLM's own prefix cache: requests
    with different salts never share chunks, and salted ones never share with unsalted
    ones. The salt, with the request's own tenant, becomes the tenant: a digest, since
    a salt is any string of any length and tenants are short printable ones. "" is
    vLLM's "no salt"."""
    if not cache_salt:
        return options
    digest = hashlib.sha256(f"{len(options.tenant)}:{options.tenant}:{cache_salt}".encode())
    return msgspec.structs.replace(options, tenant=SALTED + digest.hexdigest()[:40])
