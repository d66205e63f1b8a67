"""HTTP bearer-token refusals are counted, as CURVE refusals are: a real controller and a
real bridge with `security.http_token_file` set answer a missing or wrong token 401 and
add exactly one to `kvmesh_<service>_http_auth_failures_total{reason}` per refusal;
good tokens and the open paths (/metrics, /health) count nothing."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvtest.bridge import BridgeProcess, parse_metrics
from kvtest.controller import ControllerProcess
from kvtest.service_process import free_port

TOKEN = "s3cret-token"
TOKEN_ENV = "KVMESH_SECURITY__HTTP_TOKEN_FILE"


def call(url: str, auth: str | None, data: bytes | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def failures(base: str, service: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        samples = parse_metrics(resp.read().decode())
    name = f"kvmesh_{service}_http_auth_failures_total"
    return {r: samples[f'{name}{{reason="{r}"}}'] for r in ("missing", "wrong")}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def check_counts(base: str, service: str, guarded: str, data: bytes | None) -> None:
    assert failures(base, service) == {"missing": 0, "wrong": 0}
    cases = [
        (None, 401, "missing"),
        ("Basic dXNlcjpwYXNz", 401, "missing"),
        ("Bearer", 401, "missing"),
        ("Bearer not-the-token", 401, "wrong"),
        (f"Bearer {TOKEN}", 200, None),
    ]
    want = {"missing": 0, "wrong": 0}
    for auth, status, reason in cases:
        assert call(base + guarded, auth, data) == status, auth
        if reason is not None:
            want[reason] += 1
        assert failures(base, service) == want, auth
    # Open paths need no token and count nothing.
    assert call(base + "/health", None) in (200, 503)
    assert failures(base, service) == want


def test_controller_counts_each_refused_token(tmp_path: Path, token_file: Path) -> None:
    proc = ControllerProcess(tmp_path, snapshot=False)
    proc.env[TOKEN_ENV] = str(token_file)
    with proc:
        check_counts(proc.http, "controller", "/workers", None)
        # A refused POST runs no command and counts like a GET.
        assert call(proc.http + "/clear", "Bearer nope", b"{}") == 401
        assert failures(proc.http, "controller") == {"missing": 2 + 1, "wrong": 2}


def test_bridge_counts_each_refused_token(tmp_path: Path, token_file: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    proc = BridgeProcess(tmp_path, prefillers=[nowhere], decoders=[(nowhere, ["tcp://x:1"])])
    proc.env[TOKEN_ENV] = str(token_file)
    with proc:
        check_counts(proc.url, "bridge", "/transfers", None)
        # A token that is not UTF-8 is a wrong one, not a 500 (aiohttp hands such
        # header bytes on as lone surrogates).
        with socket.create_connection(("127.0.0.1", proc.port), timeout=30) as sock:
            sock.sendall(
                b"GET /transfers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                b"Connection: close\r\n\r\n"
            )
            answer = sock.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
        assert failures(proc.url, "bridge") == {"missing": 3, "wrong": 2}
