"""Credentials in URLs, hidden from what kvmesh prints and logs.

A remote URL may carry them (`redis://user:password@host:6379`, or `?password=` as
redis-py also reads them, docs/configuration.md); logs, `kvmesh doctor` and `kvmesh
config check` put URLs into terminals and CI logs, so secrets are shown as `***` there.
Over-hiding is the safe side: a URL that only looks like it holds one loses a part of
its display, never the other way round.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

HIDDEN = "***"
_STORE_SCHEMES = frozenset({"redis", "rediss", "redis-cluster", "kvmesh", "unix"})
# Query parameters that carry a secret (redis-py reads `password`; object stores and
# proxies use the others).
_SECRET_PARAM = re.compile(r"pass|pwd|token|secret|key|auth|credential|signature", re.I)
# Any `scheme://userinfo@` in free text (an error message quoting a URL it rewrote).
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#@'\"]*)@")


def redact_url(url: str, *, malformed: bool = False) -> str:
    """url with the password of its userinfo (all of a userinfo without ':', which
    some clients take as a password or token) and the values of secret-looking query
    parameters replaced by ***; url itself when it has neither. malformed: url is
    quoted because it does not parse, so an '@' past its authority may end a password
    holding '/', '?' or '#' whatever the scheme (as for a store's URL always)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        # Not a URL as written ("redis:/user:pw@host", a typo an error quotes): all
        # before its last '@' may be a secret.
        return f"{HIDDEN}@{url.rpartition('@')[2]}" if "@" in url else url
    # An '@' past the authority (a path's, a query's `next=a@b`) is no userinfo's...
    cut = _end_of_authority(rest, 0)
    if (malformed or scheme.lower() in _STORE_SCHEMES) and rest.rfind("@") > cut:
        # ...but in a store's URL it may be: a password may hold '/', '?' or '#' (base64
        # ones do), or sit in the query with an '@' in it. Which one it is cannot be
        # told apart, so all of it is hidden.
        return f"{scheme}://{HIDDEN}"
    netloc, tail = rest[:cut], rest[cut:]
    # rpartition: a password may hold '@' when its client does not insist on %40.
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{HIDDEN}@{hosts}" if colon else f"{HIDDEN}@{hosts}"
    return f"{scheme}://{netloc}{_redact_query(tail)}"


def _end_of_authority(rest: str, start: int) -> int:
    """Where the authority ends: at the first '/', '?' or '#' from `start` on."""
    ends = [i for i in (rest.find(c, start) for c in "/?#") if i != -1]
    return min(ends, default=len(rest))


def _redact_query(tail: str) -> str:
    path, q, query = tail.partition("?")
    if not q:
        return tail
    query, h, fragment = query.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(_SECRET_PARAM.search(k) for k, _ in pairs):
        return tail
    shown = [(k, HIDDEN if _SECRET_PARAM.search(k) else v) for k, v in pairs]
    return f"{path}?{urlencode(shown, safe='*')}{h}{fragment}"


def redact_text(text: str, url: str = "") -> str:
    """text with url redacted wherever it is quoted, whole or rewritten (a client
    that quotes `tcp://user:pw@...` for a `kvmesh://` URL), and every other
    `scheme://userinfo@` in it hidden too."""
    shown = redact_url(url) if url else url
    if shown != url:
        text = text.replace(url, shown)
        password = url.partition("://")[2].rpartition("@")[0].partition(":")[2]
        # Its raw copies too, and its pieces, as a client that cut the URL at a '/', '?'
        # '#' or ',' in it quotes them (a short piece would hide words).
        for piece in sorted({password, *re.split(r"[/?#,]", password)}, key=len, reverse=True):
            if len(piece) >= 4:
                text = text.replace(piece, HIDDEN)
    return _USERINFO.sub(_hide_userinfo, text)


def _hide_userinfo(m: re.Match[str]) -> str:
    user, colon, _ = m.group(2).partition(":")
    return f"{m.group(1)}{user}:{HIDDEN}@" if colon else f"{m.group(1)}{HIDDEN}@"


def redact_values(value: Any) -> Any:
    """A config_to_dict() tree with every URL-like string redacted."""
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_values(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value
