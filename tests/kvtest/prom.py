"""Reading a Prometheus text exposition in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of name's samples whose labels include these (0 when there are none)."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
