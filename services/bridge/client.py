"""A small HTTP client of the bridge's own endpoints (for `kvmesh admin transfers`)."""

from __future__ import annotations

import aiohttp
import msgspec

from kvmesh.services.bridge.transfers import TransferInfo


class BridgeUnavailable(Exception):
    """No answer within the deadline, or no connection."""


class BridgeError(Exception):
    """The bridge answered with an error status."""


_transfers = msgspec.json.Decoder(list[TransferInfo])


async def fetch_transfers(url: str, timeout_s: float, token: str = "") -> list[TransferInfo]:
    """GET /transfers of the bridge at `url` (http://host:port), with the bearer token
    when one is given."""
    return _transfers.decode(await _get(url.rstrip("/") + "/transfers", timeout_s, token))


async def _get(url: str, timeout_s: float, token: str = "") -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout, trust_env=False) as session,
            session.get(url, headers=headers) as resp,
        ):
            body = await resp.read()
    except TimeoutError:
        raise BridgeUnavailable(f"no answer in {timeout_s}s") from None
    except aiohttp.ClientError as exc:
        raise BridgeUnavailable(str(exc) or type(exc).__name__) from None
    if resp.status != 200:
        raise BridgeError(f"{url} answered {resp.status}: {body[:300].decode(errors='replace')}")
    return body
