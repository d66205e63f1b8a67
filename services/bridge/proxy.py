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
fallback is counted by reason and logged. A decoder that refuses the connection
(nothing reached it) is marked down and another one takes the request, without the
prefill's KV. A failed decode is: 502, or 504 past `decode_timeout_s`, with an
OpenAI-style error body; 503 when it never left the bridge, every connection of its
pool busy for `decode_timeout_s` or none to be opened (out of file descriptors...):
"saturated". The decoder's own answer, errors
included, goes back unchanged: SSE chunk by chunk when it streams, else in one piece
up to PLAIN_BUFFER_BYTES and chunk by chunk past it (never held whole in memory). It
goes back as the decoder encoded it: the decoder gets the client's Accept-Encoding,
the client the decoder's Content-Encoding, and the bridge inflates nothing.

Each prefill and decode result feeds passive ejection (backends.py): a backend that
keeps failing real requests while its /health answers 200 is taken out of rotation.
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
from kvmesh.services.bridge.backends import (
    Backend,
    BackendPool,
    PoolWait,
    describe,
    judge_status,
    local_failure,
    read_head,
)
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
# A plain (non-SSE) answer up to this size is read whole before the client gets its
# status line, so that a decoder failing mid-answer is still a proper 502/504. A larger
# one (prompt logprobs of a long prompt, a backend gone wrong) goes on as it arrives,
# at the client's pace: no answer is ever held whole in the bridge's memory.
PLAIN_BUFFER_BYTES = 4 << 20
# Of a failed prefill's answer, what goes into the log line.
PREFILL_DETAIL_BYTES = 300
# A saturated bridge's 503 tells the client to come back after this many seconds.
SATURATED_RETRY_AFTER_S = 1

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


class _Refused(Exception):
    """No connection to the decoder: nothing of the request reached it."""

    def __init__(self, exc: aiohttp.ClientConnectorError) -> None:
        super().__init__(str(exc))
        self.exc = exc


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
        except asyncio.CancelledError:
            # The client went away while sending its body: counted like any other.
            self.stats.request(endpoint, "cancelled")
            raise
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
        # The decoder counts as busy from now (its prefill included), so that the
        # requests routed meanwhile see it; `hold` moves if another decoder takes over.
        with contextlib.ExitStack() as hold:
            hold.enter_context(decoder.busy())
            return await self._run_held(
                request, endpoint, body, transfer, prefiller, decoder, reason, headers, hold
            )

    async def _run_held(
        self,
        request: web.Request,
        endpoint: Endpoint,
        body: dict[str, Any],
        transfer: Transfer,
        prefiller: Backend | None,
        decoder: Backend,
        reason: str,
        headers: dict[str, str],
        hold: contextlib.ExitStack,
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
        tried = {decoder.url}
        while True:
            data = _encoder.encode(decode_body(body, tid))
            try:
                return await self._decode(request, endpoint, decoder, data, headers)
            except _Refused as refused:
                # Nothing reached that decoder (now marked down): another one may take
                # the request as it is. Without the prompt's KV, which went to the
                # first one: it prefills itself.
                others = [b for b in self.decoders.backends if b.url not in tried]
                other = BackendPool(others).pick(include_down=False)
                if other is None:
                    return self._decode_failed(endpoint, decoder, refused.exc, headers[REQUEST_ID])
                log.warning(
                    "decoder refused the connection, another one takes the request",
                    decoder=decoder.url, to=other.url, error=describe(refused.exc),
                )  # fmt: skip
                if tid is not None:
                    tid, transfer.fallback = None, "decoder_refused"
                    self.stats.fallbacks["decoder_refused"].inc()
                hold.close()
                hold.enter_context(other.busy())
                decoder = other
                transfer.decoder = other.url
                tried.add(other.url)

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
        generation = prefiller.generation
        with prefiller.busy():
            try:
                async with self.session.post(
                    prefiller.url + PATHS[endpoint],
                    data=data,
                    headers=headers,
                    timeout=self._prefill_timeout,
                ) as resp:
                    # Thrown away but for a failure's first bytes: a prefill's answer
                    # is one token, and one without end must not fill the memory.
                    answer = await read_head(resp, PREFILL_DETAIL_BYTES)
                    prefiller.mark(True)
                    if not 200 <= resp.status < 300:
                        reason = "status"
                        detail = f"{resp.status}: {answer.decode(errors='replace')}"
                    failed = judge_status(resp.status)
                    if failed is not None:
                        self.prefillers.record(prefiller, failed, generation=generation)
            except TimeoutError:
                # Not marked down (nor counted towards ejection): a busy prefiller is
                # slow, not gone.
                reason, detail = "timeout", f"no answer in {self.config.prefill_timeout_s}s"
            except aiohttp.ClientConnectorError as exc:
                if local_failure(exc):
                    # The bridge's own want (file descriptors...), not the prefiller's.
                    reason, detail = "saturated", describe(exc)
                else:
                    reason, detail = "connect", describe(exc)
                    prefiller.mark(False, detail)
                    self.prefillers.record(prefiller, detail, generation=generation)
            except aiohttp.ClientError as exc:
                reason, detail = "error", describe(exc)
                self.prefillers.record(prefiller, detail, generation=generation)
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
        # The answer comes back as the decoder encodes it (the session inflates
        # nothing): the decoder may use only what the client can read.
        accept = request.headers.get("Accept-Encoding", "identity")
        wait = PoolWait()
        generation = decoder.generation
        try:
            resp = await self.session.post(
                decoder.url + PATHS[endpoint],
                data=data,
                headers={**headers, "Accept-Encoding": accept},
                timeout=self._decode_timeout,
                trace_request_ctx=wait.ctx,
            )
        except aiohttp.ClientConnectorError as exc:
            if local_failure(exc):
                # Out of the bridge's own file descriptors (ports, buffers): the decoder
                # is not to blame, nor would another one fare better.
                why = f"the bridge could not open a connection: {describe(exc)}"
                return self._saturated(endpoint, decoder, headers[REQUEST_ID], why)
            decoder.mark(False, describe(exc))
            self.decoders.record(decoder, describe(exc), generation=generation)
            raise _Refused(exc) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, TimeoutError) and wait.queued:
                why = (
                    "every one of its connections to the backends was in use for "
                    f"{self.config.decode_timeout_s}s"
                )
                return self._saturated(endpoint, decoder, headers[REQUEST_ID], why)
            if not isinstance(exc, TimeoutError):
                self.decoders.record(decoder, describe(exc), generation=generation)
            return self._decode_failed(endpoint, decoder, exc, headers[REQUEST_ID])
        decoder.mark(True)
        async with resp:
            outcome = "ok" if 200 <= resp.status < 300 else "decoder_status"
            answer = (decoder, generation, resp, t0, outcome, headers[REQUEST_ID])
            if resp.content_type != SSE:
                return await self._plain(request, endpoint, *answer)
            return await self._stream(request, endpoint, *answer)

    def _judge(
        self,
        decoder: Backend,
        generation: int,
        resp: aiohttp.ClientResponse,
        exc: Exception | None,
    ) -> None:
        """Passive ejection's view of a decode that got an answer (backends.py says
        what counts): an answer cut short, or a 502/503/504, is the decoder's failure;
        a deadline is not (slow, not broken), nor a 500 (maybe the request's fault)."""
        if isinstance(exc, TimeoutError):
            return
        error = describe(exc) if exc is not None else judge_status(resp.status)
        if error is not None:
            self.decoders.record(decoder, error, generation=generation)

    async def _plain(
        self,
        request: web.Request,
        endpoint: Endpoint,
        decoder: Backend,
        generation: int,
        resp: aiohttp.ClientResponse,
        t0: float,
        outcome: str,
        request_id: str,
    ) -> web.StreamResponse:
        """A non-SSE answer: read whole when it is small (PLAIN_BUFFER_BYTES), else
        passed on as it arrives; either way written to the client within the per-write
        deadline (`_send`), so a client that stops reading holds nothing for long."""
        content_type = resp.headers.get("Content-Type", "application/json")
        chunks = resp.content.iter_any()
        head = bytearray()
        whole = False
        try:
            async for chunk in chunks:
                head += chunk
                if len(head) > PLAIN_BUFFER_BYTES:
                    break
            else:
                whole = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._judge(decoder, generation, resp, exc)
            return self._decode_failed(endpoint, decoder, exc, request_id)
        self.stats.decode_ttfb.observe(time.perf_counter() - t0)
        out = web.StreamResponse(
            status=resp.status, headers=_answer_headers(resp, content_type, request_id)
        )
        if whole:
            out.content_length = len(head)
        elif resp.content_length is not None:
            # The decoder's own length (the session inflates nothing, so it is the
            # length of what is passed on): a client can tell an answer cut short, an
            # HTTP/1.0 one too (no chunked framing there).
            out.content_length = resp.content_length
        try:
            await self._send(request, out.prepare(request))
            await self._send(request, out.write(head))
            head = bytearray()
            if not whole:
                async for chunk in chunks:
                    await self._send(request, out.write(chunk))
            await self._send(request, out.write_eof())
        except ConnectionResetError as exc:
            self.stats.request(endpoint, "cancelled")
            log.info("client went away while answered", error=str(exc))
            return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The status line is gone and a plain answer has no place for an error:
            # the connection is cut, so that the client sees an answer cut short
            # (short of its length, or chunked without its last chunk), never a short
            # one that looks whole.
            _, outcome, message = self._failure(decoder, exc)
            log.warning("decoder failed mid-answer", decoder=decoder.url, error=message)
            if request.transport is not None:
                request.transport.abort()
            self._judge(decoder, generation, resp, exc)
            self.stats.request(endpoint, outcome)
            return out
        # Counted once the answer is all out: a client gone at the last write is
        # "cancelled" above, not both.
        self._judge(decoder, generation, resp, None)
        self.stats.request(endpoint, outcome)
        log.debug("request answered", status=resp.status, outcome=outcome)
        return out

    async def _stream(
        self,
        request: web.Request,
        endpoint: Endpoint,
        decoder: Backend,
        generation: int,
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
            self._judge(decoder, generation, resp, exc)
            return self._decode_failed(endpoint, decoder, exc, request_id)
        self.stats.decode_ttfb.observe(time.perf_counter() - t0)
        content_type = resp.headers.get("Content-Type", SSE)
        headers = _answer_headers(resp, content_type, request_id)
        headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=resp.status, headers=headers)
        failure: Exception | None = None
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
            failure = exc
            status, outcome, message = self._failure(decoder, exc)
            log.warning("decoder failed while streaming", decoder=decoder.url, error=message)
            if "Content-Encoding" in headers:
                # A plain event in an encoded stream would be garbage to the client:
                # the connection is cut instead (a stream without its end).
                if request.transport is not None:
                    request.transport.abort()
                self._judge(decoder, generation, resp, exc)
                self.stats.request(endpoint, outcome)
                return out
            # The status line is gone: say it in the stream, as vLLM does.
            event = b"data: " + error_json(status, message) + b"\n\n"
            with contextlib.suppress(ConnectionResetError):
                await self._send(request, out.write(event))
        with contextlib.suppress(ConnectionResetError):
            await self._send(request, out.write_eof())
        # After the last write: a cancel there (the client gone) is counted by serve()
        # alone.
        self._judge(decoder, generation, resp, failure)
        self.stats.request(endpoint, outcome)
        log.debug("request streamed", status=resp.status, outcome=outcome)
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

    def _saturated(
        self, endpoint: Endpoint, decoder: Backend, request_id: str, why: str
    ) -> web.Response:
        """The decode never left the bridge: all its outgoing connections were busy
        (POOL_CONNECTIONS, server.py) for decode_timeout_s, or it could not open one
        (out of file descriptors...). The bridge's own limit, not the decoder's
        failure: 503, and the client may retry."""
        self.stats.request(endpoint, "saturated")
        message = f"the bridge is saturated: {why}, the request was not sent; retry later"
        log.warning("bridge saturated, request refused", decoder=decoder.url, error=why)
        response = error_response(503, message, None, request_id)
        response.headers["Retry-After"] = str(SATURATED_RETRY_AFTER_S)
        return response

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


def _answer_headers(
    resp: aiohttp.ClientResponse, content_type: str, request_id: str
) -> dict[str, str]:
    """The headers of the decoder's answer that go back with it: its type, and its
    encoding (the bytes are passed on as they came: without the header a client could
    not read them)."""
    # Vary: the decoder was asked with the client's Accept-Encoding, so a cache must
    # not hand this answer to a client that accepts other encodings.
    headers = {"Content-Type": content_type, REQUEST_ID: request_id, "Vary": "Accept-Encoding"}
    encoding = resp.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() != "identity":
        headers["Content-Encoding"] = encoding
    return headers
