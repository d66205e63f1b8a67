"""common/observability/http_auth.py: why a request is refused, and BearerAuth's count
of refusals by reason (what `kvmesh_<service>_http_auth_failures_total` shows)."""

from __future__ import annotations

from kvmesh.common.observability import Metrics
from kvmesh.common.observability.http_auth import BearerAuth, refusal


def test_refusal_reasons() -> None:
    assert refusal("Bearer tok", "tok") is None and refusal(None, "") is None
    assert refusal(None, "tok") == "missing" and refusal("", "tok") == "missing"
    assert refusal("Bearer", "tok") == "missing" and refusal("Bearer  ", "tok") == "missing"
    assert refusal("Basic dG9r", "tok") == "missing"  # no bearer token at all
    assert refusal("Bearer nope", "tok") == "wrong" and refusal("bearer tok2", "tok") == "wrong"


def failures(metrics: Metrics, reason: str) -> float | None:
    return metrics.value("svc_http_auth_failures_total", {"reason": reason})


def test_each_refusal_counts_once_by_reason() -> None:
    metrics = Metrics()
    auth = BearerAuth("tok", metrics, "svc")
    assert failures(metrics, "missing") == 0 and failures(metrics, "wrong") == 0
    assert auth.allows("Bearer tok")
    assert not auth.allows(None) and not auth.allows("Basic x")
    assert not auth.allows("Bearer nope")
    assert failures(metrics, "missing") == 2 and failures(metrics, "wrong") == 1


def test_without_a_token_everything_passes_and_nothing_counts() -> None:
    metrics = Metrics()
    auth = BearerAuth("", metrics, "svc")
    assert auth.allows(None) and auth.allows("Bearer anything")
    assert failures(metrics, "missing") == 0 and failures(metrics, "wrong") == 0
