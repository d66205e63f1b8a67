"""One client request through the bridge: pick a decoder and a prefiller, prefill,
decode, answer.

With `lookup_url` set, the backend that computes the prompt (the prefiller, else the
decoder) is the one holding the longest cached prefix of it (prefix_lookup.py asks,
routing.py chooses); a lookup that fails or has nothing worth it leaves the least
loaded one, and the request goes on: routing never fails a request.

    client ──POST──▶ bridge ──prefill (max_tokens 1, kv_transfer_params.kvmesh.pd)──▶ prefiller
                       │          the prefiller pushes the prompt's KV to the decoder and
                       │          answers once it has landed (or failed)
                       └──decode (the client's body + pd.transfer_id)──▶ decoder ──▶ client

A failed prefill (refused, non-2xx, past `prefill_timeout_s`) is not the client's
problem: the decode goes out without `pd` and the decoder prefills itself; the
fallback is counted by reason and logged. A failed decode is: 502, or 504 past
`decode_timeout_s`, with an OpenAI-style error body. The decoder's own answer, errors
included, goes back unchanged: SSE chunk by chunk when it streams, else in one piece.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web

from kvmesh.common.config.schema import BridgeConfig
from kvmesh.common.observability import get_logger
from kvmesh.services.bridge.backends import Backend, BackendPool, describe
from kvmesh.services.bridge.openai import BadRequest, Endpoint, error_json, parse_request
from kvmesh.services.bridge.prefix_lookup import LookupFailed, PrefixLookup
from kvmesh.services.bridge.request_ids import REQUEST_ID, client_request_id
from kvmesh.services.bridge.rewrite import decode_body, prefill_body
from kvmesh.services.bridge.routing import Choice, PrefixHits, choose, whole_prompt_tokens
from kvmesh.services.bridge.stats import BridgeStats
from kvmesh.services.bridge.transfers import Transfer, TransferTable

log = get_logger(__name__)

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Client headers worth passing on: a backend started with --api-key needs the key.
FORWARDED_HEADERS = ("Authorization",)
SSE = "text/event-stream"

_encoder = msgspec.json.Encoder()


def error_response(
    status: int, message: str, param: str | None = None, request_id: str = ""
) -> web.Response:
    return web.Response(
        status=status,
        body=error_json(status, message, param),
        content_type="application/json",
        headers={REQUEST_ID: request_id} if request_id else None,
    )


class Proxy:
    def __init__(
        self,
        config: BridgeConfig,
        session: aiohttp.ClientSession,
        prefillers: BackendPool,
        decoders: BackendPool,
        transfers: TransferTable,
        stats: BridgeStats,
        lookup: PrefixLookup | None = None,
    ) -> None:
        self.config = config
        # None: KV-aware routing is off (bridge.lookup_url unset).
        self.lookup = lookup
        self.session = session
        self.prefillers = prefillers
        self.decoders = decoders
        self.transfers = transfers
        self.stats = stats
        self._prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout_s)
        # No total: a streamed answer may rightly take minutes. Getting a connection
        # (a free one from the pool, or a new one) and each read (the first byte, then
        # every next one) have decode_timeout_s each.
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=config.decode_timeout_s,
            sock_connect=config.decode_timeout_s,
            sock_read=config.decode_timeout_s,
        )

    async def serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        transfer_id = uuid.uuid4().hex
        # The client's request id when it sent a usable one, else the transfer id: it
        # goes to the prefiller and the decoder (vLLM names its request after it, and
        # kvmesh's connector logs that name), back to the client (on the bridge's own
        # refusals and failures too), and on every line logged here for the request.
        request_id = client_request_id(request) or transfer_id
        try:
            body = parse_request(await self._read_body(request), endpoint)
        except BadRequest as exc:
            self.stats.request(endpoint, "bad_request")
            log.info(
                "request refused", endpoint=endpoint, status=exc.status, error=str(exc),
                request_id=request_id,
            )  # fmt: skip
            return error_response(exc.status, str(exc), exc.param, request_id)
        if not self.decoders.backends:
            self.stats.request(endpoint, "no_decoder")
            return error_response(503, "the bridge has no decoder configured", None, request_id)
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        headers["Content-Type"] = "application/json"
        headers[REQUEST_ID] = request_id
        with structlog.contextvars.bound_contextvars(
            request_id=request_id, transfer_id=transfer_id
        ):
            try:
                hits, route_fallback = await self._lookup(endpoint, body, headers)
            except asyncio.CancelledError:
                self.stats.request(endpoint, "cancelled")
                raise
            decoder, prefiller, reason = self._choose(hits)
            computing = prefiller or decoder
            transfer = Transfer(
                transfer_id,
                endpoint,
                prefiller.backend.url if prefiller else "",
                decoder.backend.url,
                bool(body.get("stream")),
            )
            transfer.route, transfer.hit_tokens = computing.by, computing.hit_tokens
            transfer.prompt_tokens = hits.prompt_tokens if hits else 0
            transfer.route_fallback = route_fallback
            self.transfers.add(transfer)
            try:
                with decoder.backend.busy():
                    return await self._run(
                        request,
                        endpoint,
                        body,
                        transfer,
                        prefiller.backend if prefiller else None,
                        decoder.backend,
                        reason,
                        headers,
                    )
            except asyncio.CancelledError:
                self.stats.request(endpoint, "cancelled")
                log.info("client went away", phase=transfer.phase)
                raise
            finally:
                self.transfers.remove(transfer.transfer_id)

    # -- routing ------------------------------------------------------------------------
    async def _lookup(
        self, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[PrefixHits | None, str]:
        """Where the prompt is cached, or (None, why not); None and "" when lookup is off."""
        if self.lookup is None:
            return None, ""
        # The pool whose choice the hits decide (see _choose) tokenizes: any healthy
        # backend would do, and that one is about to read the prompt anyway.
        pool = self.prefillers if self.prefillers.backends else self.decoders
        tokenizer = next((b for b in pool.by_preference() if b.state != "down"), None)
        t0 = time.perf_counter()
        try:
            hits = await self.lookup.hits(endpoint, body, tokenizer, headers)
        except LookupFailed as exc:
            self.stats.route_fallbacks[exc.reason].inc()
            return None, exc.reason
        finally:
            self.stats.route_seconds.observe(time.perf_counter() - t0)
        self.stats.route_prompt_tokens.inc(hits.prompt_tokens)
        return hits, ""

    def _choose(self, hits: PrefixHits | None) -> tuple[Choice, Choice | None, str]:
        """The decoder, the prefiller (None: no prefill) and why there is none.

        Without prefillers the decoder computes the prompt: the one holding the longest
        prefix gets it. With prefillers the prefiller computes it and the decoder only
        decodes: the decoder is the least loaded, unless one holds nearly the whole
        prompt already, which then decodes without a prefill ("decoder_cached")."""
        cfg = self.config
        least = self.decoders.pick(include_down=True)
        assert least is not None  # serve() checked there is a decoder
        pd = bool(self.prefillers.backends)
        need = cfg.lookup_min_hit_tokens
        if pd and hits is not None:
            need = whole_prompt_tokens(hits, cfg.lookup_min_hit_tokens)
        decoder = choose(
            least, self.decoders.backends, hits,
            min_tokens=need, max_extra_inflight=cfg.lookup_max_extra_inflight,
        )  # fmt: skip
        self._count("decoder", decoder)
        if pd and decoder.by == "kv":
            prefiller, reason = None, "decoder_cached"
        else:
            prefiller, reason = self._choose_prefiller(decoder.backend, hits)
        if hits is not None:
            computing = prefiller or decoder
            log.debug(
                "routed", decoder=decoder.backend.url,
                prefiller=prefiller.backend.url if prefiller else None, by=computing.by,
                hit_tokens=computing.hit_tokens, prompt_tokens=hits.prompt_tokens,
            )  # fmt: skip
        return decoder, prefiller, reason

    def _choose_prefiller(
        self, decoder: Backend, hits: PrefixHits | None
    ) -> tuple[Choice | None, str]:
        """The prefiller, or why there is none to use."""
        if not self.prefillers.backends:
            return None, "no_prefiller"
        if not decoder.kv_endpoints:
            return None, "no_kv_endpoints"
        # A prefiller known to be down would cost each request a failed call (up to
        # prefill_timeout_s); the health checks bring it back.
        least = self.prefillers.pick(include_down=False)
        if least is None:
            return None, "prefiller_down"
        prefiller = choose(
            least, self.prefillers.backends, hits,
            min_tokens=self.config.lookup_min_hit_tokens,
            max_extra_inflight=self.config.lookup_max_extra_inflight,
        )  # fmt: skip
        self._count("prefiller", prefiller)
        return prefiller, ""

    def _count(self, role: str, choice: Choice) -> None:
        self.stats.routes[(role, choice.by)].inc()
        self.stats.route_hit_tokens[role].inc(choice.hit_tokens)

    async def _run(
        self,
        request: web.Request,
        endpoint: Endpoint,
        body: dict[str, Any],
        transfer: Transfer,
        prefiller: Backend | None,
        decoder: Backend,
        reason: str,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        if prefiller is not None:
            reason = await self._prefill(endpoint, body, transfer, prefiller, decoder, headers)
        elif reason:
            # Without prefillers (or endpoints) in the config, every request is one of
            # these: not worth a warning each; nor is a decoder that holds the prompt,
            # nor a prefiller marked down (backends.py warned once when it went down).
            quiet = ("no_prefiller", "no_kv_endpoints", "decoder_cached", "prefiller_down")
            log_at = log.debug if reason in quiet else log.warning
            log_at("decoding without a prefill", reason=reason, decoder=decoder.url)
        if reason:
            transfer.fallback = reason
            self.stats.fallbacks[reason].inc()
        transfer.phase = "decode"
        tid = None if reason else transfer.transfer_id
        data = _encoder.encode(decode_body(body, tid))
        return await self._decode(request, endpoint, decoder, data, headers)

    async def _prefill(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        transfer: Transfer,
        prefiller: Backend,
        decoder: Backend,
        headers: dict[str, str],
    ) -> str:
        """Run the prefill; "" when it succeeded, else the fallback reason."""
        data = _encoder.encode(
            prefill_body(
                body,
                chat=endpoint == "chat",
                transfer_id=transfer.transfer_id,
                endpoints=decoder.kv_endpoints,
            )
        )
        reason = detail = ""
        t0 = time.perf_counter()
        with prefiller.busy():
            try:
                async with self.session.post(
                    prefiller.url + PATHS[endpoint],
                    data=data,
                    headers=headers,
                    timeout=self._prefill_timeout,
                ) as resp:
                    answer = await resp.read()
                    prefiller.mark(True)
                    if not 200 <= resp.status < 300:
                        reason = "status"
                        detail = f"{resp.status}: {answer[:300].decode(errors='replace')}"
            except TimeoutError:
                # Not marked down: a busy prefiller is slow, not gone.
                reason, detail = "timeout", f"no answer in {self.config.prefill_timeout_s}s"
            except aiohttp.ClientConnectorError as exc:
                reason, detail = "connect", describe(exc)
                prefiller.mark(False, detail)
            except aiohttp.ClientError as exc:
                reason, detail = "error", describe(exc)
        seconds = time.perf_counter() - t0
        (self.stats.prefill_failed if reason else self.stats.prefill_ok).observe(seconds)
        if reason:
            log.warning(
                "prefill failed, the decoder prefills itself", reason=reason,
                prefiller=prefiller.url, decoder=decoder.url, error=detail,
                seconds=round(seconds, 4),
            )  # fmt: skip
        return reason

    async def _decode(
        self,
        request: web.Request,
        endpoint: Endpoint,
        decoder: Backend,
        data: bytes,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            resp = await self.session.post(
                decoder.url + PATHS[endpoint],
                data=data,
                headers=headers,
                timeout=self._decode_timeout,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                decoder.mark(False, describe(exc))
            return self._decode_failed(endpoint, decoder, exc, headers[REQUEST_ID])
        decoder.mark(True)
        async with resp:
            outcome = "ok" if 200 <= resp.status < 300 else "decoder_status"
            content_type = resp.headers.get("Content-Type", "application/json")
            if resp.content_type != SSE:
                try:
                    answer = await resp.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    return self._decode_failed(endpoint, decoder, exc, headers[REQUEST_ID])
                self.stats.decode_ttfb.observe(time.perf_counter() - t0)
                self.stats.request(endpoint, outcome)
                log.debug("request answered", status=resp.status, outcome=outcome)
                return web.Response(
                    status=resp.status,
                    body=answer,
                    headers={"Content-Type": content_type, REQUEST_ID: headers[REQUEST_ID]},
                )
            return await self._stream(
                request, endpoint, decoder, resp, t0, outcome, headers[REQUEST_ID]
            )

    async def _stream(
        self,
        request: web.Request,
        endpoint: Endpoint,
        decoder: Backend,
        resp: aiohttp.ClientResponse,
        t0: float,
        outcome: str,
        request_id: str,
    ) -> web.StreamResponse:
        chunks = resp.content.iter_any()
        # The client's headers wait for the decoder's first chunk: until then a
        # failure can still be a proper 502/504.
        try:
            first = await anext(chunks, b"")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return self._decode_failed(endpoint, decoder, exc, request_id)
        self.stats.decode_ttfb.observe(time.perf_counter() - t0)
        content_type = resp.headers.get("Content-Type", SSE)
        out = web.StreamResponse(
            status=resp.status,
            headers={
                "Content-Type": content_type,
                "Cache-Control": "no-cache",
                REQUEST_ID: request_id,
            },
        )
        try:
            await self._send(request, out.prepare(request))
            if first:
                await self._send(request, out.write(first))
            async for chunk in chunks:
                await self._send(request, out.write(chunk))
        except ConnectionResetError as exc:
            # The client went away (or stopped reading); leaving `async with resp`
            # drops the decoder's connection, which makes vLLM abort the request.
            self.stats.request(endpoint, "cancelled")
            log.info("client went away while streaming", error=str(exc))
            return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The status line is gone: say it in the stream, as vLLM does.
            status, outcome, message = self._failure(decoder, exc)
            log.warning("decoder failed while streaming", decoder=decoder.url, error=message)
            event = b"data: " + error_json(status, message) + b"\n\n"
            with contextlib.suppress(ConnectionResetError):
                await self._send(request, out.write(event))
        self.stats.request(endpoint, outcome)
        log.debug("request streamed", status=resp.status, outcome=outcome)
        with contextlib.suppress(ConnectionResetError):
            await self._send(request, out.write_eof())
        return out

    async def _send(self, request: web.Request, write: Awaitable[object]) -> None:
        """One write to the client, within decode_timeout_s. A client that stops reading
        without closing would otherwise hold the write, the decoder's request and a
        pooled connection for good (aiohttp stops the decoder-side read timer while
        reading is paused). Past the deadline its connection is dropped, since nothing
        queued for it could be delivered, and this raises ConnectionResetError as for a
        client gone away."""
        try:
            async with asyncio.timeout(self.config.decode_timeout_s):
                await write
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(
                f"the client read nothing for {self.config.decode_timeout_s}s"
            ) from None

    def _decode_failed(
        self, endpoint: Endpoint, decoder: Backend, exc: BaseException, request_id: str
    ) -> web.Response:
        status, outcome, message = self._failure(decoder, exc)
        self.stats.request(endpoint, outcome)
        log.warning("decode failed", decoder=decoder.url, status=status, error=message)
        return error_response(status, message, None, request_id)

    def _failure(self, decoder: Backend, exc: BaseException) -> tuple[int, str, str]:
        if isinstance(exc, TimeoutError):
            message = f"the decoder {decoder.url} sent nothing for {self.config.decode_timeout_s}s"
            return 504, "decoder_timeout", message
        return 502, "decoder_failed", f"the decoder {decoder.url} failed: {describe(exc)}"

    async def _read_body(self, request: web.Request) -> bytes:
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            # Inflating is CPU work on the event loop, and a small body can inflate to
            # gigabytes: the server does not decompress (auto_decompress=False), and a
            # compressed body is refused before any of it is read.
            raise BadRequest(
                415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed"
            )
        limit = int(self.config.max_body_bytes)
        too_large = f"the request body is over the bridge's limit of {limit} bytes"
        if request.content_length is not None and request.content_length > limit:
            raise BadRequest(413, f"{too_large} ({request.content_length} bytes)")
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body, without a length
            raise BadRequest(413, too_large) from None
        except TimeoutError:
            raise BadRequest(
                408, f"the request body did not arrive within {self.config.request_timeout_s}s"
            ) from None
