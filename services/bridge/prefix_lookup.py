"""Where a request's prompt is cached: its token ids, then the lookup-server's
`BestInstances` answer (how many leading tokens each kvmesh instance holds).

Token ids come from the request when it carries them (a completion's prompt as ids),
else from a backend's own tokenizer (vLLM's POST /tokenize, which takes a completion's
prompt or a chat's messages and renders them as the completion would): the bridge
needs no model files, and the ids are exactly what the engines hash. The backend asked
is any healthy one; they all serve the same model.

Every step has a deadline (`tokenize_timeout_s`, `lookup_timeout_s`). Whatever goes
wrong raises `LookupFailed` with a reason the proxy counts, and the request goes to
the least loaded backend: routing never fails or stalls a request. Prompts shorter
than `lookup_min_hit_tokens` are not looked up (no hit could be worth it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec

from kvmesh.common.config.schema import BridgeConfig
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol.lookup import MAX_TOKENS
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.common.transport.lookup_service_client import (
    LookupServiceClient,
    LookupServiceError,
    LookupServiceUnavailable,
)
from kvmesh.services.bridge.backends import Backend, describe, local_failure, read_limited
from kvmesh.services.bridge.openai import Endpoint
from kvmesh.services.bridge.routing import PrefixHits

log = get_logger(__name__)

# Chat fields that change how vLLM renders the messages into the prompt.
CHAT_RENDER_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class LookupFailed(Exception):
    """No usable answer; `reason` is a label of kvmesh_bridge_route_fallbacks_total."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class TokenizeReply(msgspec.Struct):
    tokens: list[int]


_tokenize_reply = msgspec.json.Decoder(TokenizeReply)
_encoder = msgspec.json.Encoder()


# LookupFailed reasons that come from the request itself.
_REQUEST_REASONS = ("batch", "tenant", "tokenize_refused")


def names_a_tenant(body: Mapping[str, Any]) -> bool:
    """Whether the request's chunks live under a tenant of their own (vLLM's cache_salt,
    or the kvmesh tenant in kv_transfer_params): the registry counts no tenant's chunks,
    so its hits would be another tenant's copies, of no use to this request (and, in
    disaggregated prefill, would skip its prefill for a decoder that then misses)."""
    if body.get("cache_salt"):
        return True
    params = body.get("kv_transfer_params")
    kvmesh = params.get("kvmesh") if isinstance(params, Mapping) else None
    return isinstance(kvmesh, Mapping) and bool(kvmesh.get("tenant"))


def prompt_token_ids(endpoint: Endpoint, body: Mapping[str, Any]) -> list[int] | str | None:
    """A completion's prompt as ids when it is ids, as text when it is one string; None
    for a chat (its messages go to /tokenize). LookupFailed("batch") for several
    prompts: they may share nothing, and one backend gets them all anyway."""
    if endpoint == "chat":
        return None
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(t, int) for t in prompt):
        return prompt
    raise LookupFailed("batch", f"{len(prompt)} prompts in one request")


def tokenize_body(endpoint: Endpoint, body: Mapping[str, Any], prompt: str | None) -> bytes:
    out: dict[str, Any] = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if endpoint == "chat":
        out["messages"] = body["messages"]
        out.update((k, body[k]) for k in CHAT_RENDER_KEYS if k in body)
    else:
        out["prompt"] = prompt
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
    return _encoder.encode(out)


class PrefixLookup:
    """`async with PrefixLookup(config, session)`; then `hits(...)` per request."""

    def __init__(
        self,
        config: BridgeConfig,
        session: aiohttp.ClientSession,
        curve: CurveKeys | None = None,
    ) -> None:
        self.config = config
        self.session = session
        self.client = LookupServiceClient(
            config.lookup_url, timeout_s=config.lookup_timeout_s, name="bridge", curve=curve
        )
        self._tokenize_timeout = aiohttp.ClientTimeout(total=config.tokenize_timeout_s)
        # The reason of the last failure, "" while lookups work: a lookup-server that
        # is down must not cost one warning per request.
        self._failing = ""

    async def __aenter__(self) -> PrefixLookup:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(*exc)

    async def hits(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        tokenizer: Backend | None,
        headers: Mapping[str, str],
    ) -> PrefixHits:
        """The prompt's cached prefix per instance, or LookupFailed."""
        try:
            found = await self._hits(endpoint, body, tokenizer, headers)
        except LookupFailed as exc:
            if exc.reason in _REQUEST_REASONS:
                # This request's own shape, not the lookup's health: the state of the
                # once-per-reason warnings is left as it is.
                log.debug("KV-aware routing skipped", reason=exc.reason, error=str(exc))
                raise
            if exc.reason != self._failing:
                log.warning(
                    "KV-aware routing failed; least loaded instead (said once per reason)",
                    reason=exc.reason,
                    error=str(exc),
                )
                self._failing = exc.reason
            raise
        if self._failing:
            log.info("KV-aware routing works again", after=self._failing)
            self._failing = ""
        return found

    async def _hits(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        tokenizer: Backend | None,
        headers: Mapping[str, str],
    ) -> PrefixHits:
        if names_a_tenant(body):
            raise LookupFailed("tenant", "the request names a tenant or a cache_salt")
        prompt = prompt_token_ids(endpoint, body)
        if isinstance(prompt, list):
            tokens = prompt
        else:
            if tokenizer is None:
                raise LookupFailed("tokenize", "no backend is up to tokenize the prompt")
            tokens = await self.tokenize(tokenizer, tokenize_body(endpoint, body, prompt), headers)
        if len(tokens) < self.config.lookup_min_hit_tokens:
            return PrefixHits(len(tokens))
        # Prefix semantics: the head of an over-long prompt is all the server reads anyway.
        head = tokens[:MAX_TOKENS]
        try:
            found = await self.client.best_instances(head, timeout_s=self.config.lookup_timeout_s)
        except LookupServiceUnavailable as exc:
            raise LookupFailed("lookup_timeout", describe(exc)) from None
        except LookupServiceError as exc:
            raise LookupFailed("lookup_error", str(exc)) from None
        except ValueError as exc:  # a token id outside uint32: vLLM refuses it too
            raise LookupFailed("batch", str(exc)) from None
        return PrefixHits(len(tokens), {h.instance_id: h.hit_tokens for h in found})

    async def tokenize(
        self, backend: Backend, data: bytes, headers: Mapping[str, str]
    ) -> list[int]:
        try:
            async with self.session.post(
                backend.url + "/tokenize",
                data=data,
                headers=headers,
                timeout=self._tokenize_timeout,
            ) as resp:
                # Token ids of a prompt no longer than the request body: a few bytes
                # each. More is a backend gone wrong, not an answer to buffer.
                limit = 16 * int(self.config.max_body_bytes) + (1 << 16)
                answer = await read_limited(resp, limit)
        except TimeoutError:
            raise LookupFailed(
                "tokenize_timeout",
                f"{backend.url}/tokenize: no answer in {self.config.tokenize_timeout_s}s",
            ) from None
        except aiohttp.ClientError as exc:
            # Not when the bridge itself ran out of file descriptors (ports...).
            if isinstance(exc, aiohttp.ClientConnectorError) and not local_failure(exc):
                backend.mark(False, describe(exc))
            raise LookupFailed("tokenize", f"{backend.url}/tokenize: {describe(exc)}") from None
        if resp.status != 200:
            # Often the client's own mistake (an unknown model): the decode gets the same
            # answer from the backend, and passes it on.
            text = answer[:300].decode(errors="replace")
            # A 4xx is this request's own fault (an unknown model...), not the backend's.
            reason = "tokenize_refused" if 400 <= resp.status < 500 else "tokenize"
            raise LookupFailed(reason, f"{backend.url}/tokenize answered {resp.status}: {text}")
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            # The session inflates nothing (server.py) and asked for it plain.
            raise LookupFailed(
                "tokenize", f"{backend.url}/tokenize answered in Content-Encoding {encoding!r}"
            )
        try:
            return _tokenize_reply.decode(answer).tokens
        except msgspec.DecodeError as exc:
            raise LookupFailed("tokenize", f"{backend.url}/tokenize: {exc}") from None
