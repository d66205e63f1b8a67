"""The two requests the bridge makes of one client request: the prefill (to a
prefiller) and the decode (to a decoder).

The contract with the kvmesh connector lives in `kv_transfer_params["kvmesh"]["pd"]`:
the prefill carries `{"transfer_id", "endpoints"}` (where the decoder's ranks receive
the KV), the decode `{"transfer_id"}` (which pushed KV to use). Without `pd` a decoder
prefills the prompt itself. The client's own kvmesh keys (e.g. its tenant) go to both,
and any other key of the client's kv_transfer_params is kept.

Pure functions over the client's JSON object; they return new dicts and never change
the one they are given.
"""

from __future__ import annotations

from typing import Any

KVMESH = "kvmesh"
PD = "pd"


def prefill_body(
    body: dict[str, Any], *, chat: bool, transfer_id: str, endpoints: list[str]
) -> dict[str, Any]:
    """The prefiller computes the prompt and pushes its KV: one token, no stream."""
    out = dict(body)
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if "min_tokens" in body:
        # vLLM refuses min_tokens above max_tokens; the prefill's token is thrown away.
        out["min_tokens"] = 0
    out["stream"] = False
    out.pop("stream_options", None)
    return _with_pd(out, {"transfer_id": transfer_id, "endpoints": list(endpoints)})


def decode_body(body: dict[str, Any], transfer_id: str | None) -> dict[str, Any]:
    """The client's request as it came, told which transfer holds its KV; with no
    transfer_id (the prefill failed or was skipped) the decoder prefills itself."""
    if transfer_id is not None:
        return _with_pd(dict(body), {"transfer_id": transfer_id})
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or PD not in (params.get(KVMESH) or {}):
        return body
    return _with_pd(dict(body), None)


def _with_pd(out: dict[str, Any], pd: dict[str, Any] | None) -> dict[str, Any]:
    params = dict(out.get("kv_transfer_params") or {})
    kvmesh = {k: v for k, v in (params.get(KVMESH) or {}).items() if k != PD}
    if pd is not None:
        kvmesh[PD] = pd
    params[KVMESH] = kvmesh
    out["kv_transfer_params"] = params
    return out
