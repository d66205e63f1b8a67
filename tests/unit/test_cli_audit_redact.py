"""redact_url: what `kvmesh doctor` and `kvmesh config check` print of a URL."""

from __future__ import annotations

import pytest

from kvmesh.common.redact import redact_text, redact_url, redact_values


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:pw@host", "redis://:***@host"),
        ("rediss://tok3n@host:6380", "rediss://***@host:6380"),
        ("redis-cluster://u:p@a:7000,b:7001", "redis-cluster://u:***@a:7000,b:7001"),
        ("redis://u:p@ss@host/1", "redis://u:***@host/1"),
        ("redis://host:6379", "redis://host:6379"),
        ("tcp://127.0.0.1:7600", "tcp://127.0.0.1:7600"),
        ("http://host/a@b", "http://host/a@b"),
        # redis-py reads a password from the query too.
        ("redis://h:6379/0?password=s3cr3t", "redis://h:6379/0?password=***"),
        ("redis://u:p@h/0?db=1&token=abc#f", "redis://u:***@h/0?db=1&token=***#f"),
        # An '@' past the authority is no userinfo.
        ("http://h?next=a@b", "http://h?next=a@b"),
        ("http://dec:8000?tag=a@b", "http://dec:8000?tag=a@b"),
        # ...except in a store's URL, where a password may hold '/', '?' or '#' (base64
        # ones do), or an '@' in the query: which it is cannot be told, so all goes.
        ("redis-cluster://u:p?ss@h:1,h2:2", "redis-cluster://***"),
        ("redis://:Zm9v/YmFy+cXV4@cache:6379/0", "redis://***"),
        ("redis://user:p#ss@host/0", "redis://***"),
        ("kvmesh://:Zm9v/YmFy@cache:7700", "kvmesh://***"),
        ("rediss://cache:6380/0?password=Zx9@Q2mLk7Tt", "rediss://***"),
        ("redis://localhost:6379/0?client_name=svc@pod", "redis://***"),
        # A typo'd URL an error quotes: all before its last '@' is hidden.
        ("redis:/alice:s3cret@cache:6379", "***@cache:6379"),
        ("", ""),
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_and_values() -> None:
    url = "redis://u:pw@h:1"
    assert redact_text(f"no port in {url}", url) == "no port in redis://u:***@h:1"
    tree = {"a": {"url": url, "n": 1, "l": [url, "x"]}, "b": "plain"}
    assert redact_values(tree) == {
        "a": {"url": "redis://u:***@h:1", "n": 1, "l": ["redis://u:***@h:1", "x"]},
        "b": "plain",
    }


def test_redact_text_hides_rewritten_and_cut_copies() -> None:
    """A client quoting the URL it rewrote (tcp:// for kvmesh://) and an error cut to
    its first characters kept the password."""
    url = "kvmesh://alice:s3cret@127.0.0.1:7700"
    said = "ZMQError: Invalid argument (addr='tcp://alice:s3cret@127.0.0.1:7700')"
    assert "s3cret" not in redact_text(said, url)
    assert "tcp://alice:***@127.0.0.1:7700" in redact_text(said, url)
    long_url = "s3://AKIA:SECRETKEY@bucket/" + "p" * 300
    assert "SECRET" not in redact_text(f"ValueError: no port in {long_url}", long_url)[:300]


def test_redact_text_hides_the_pieces_of_a_password_a_client_cut() -> None:
    """redis-py cut `redis://:Zm9v/YmFy+cXV4@...` at the '/' and quoted what it took
    for a port."""
    url = "redis://:Zm9v/YmFy+cXV4@cache.internal:6379/0"
    said = "ValueError: Port could not be cast to integer value as 'Zm9v'"
    assert "Zm9v" not in redact_text(said, url)


@pytest.mark.parametrize(
    ("scheme", "rest", "first"),
    [
        ("redis", "u:s3cr,etpass@h1:6379", ("h1", 6379)),
        ("redis", "u:pa/ss@h:1/0", ("h", 1)),
        ("redis-cluster", "fd00::5:7000,h2:7001", ("fd00::5", 7000)),
        ("redis-cluster", ",a:7001", ("a", 7001)),
        ("rediss", "h", ("h", 6379)),
    ],
)
def test_doctor_dials_the_first_server_the_connector_would(scheme, rest, first) -> None:
    """doctor had a parser of its own: it cut a password at a ',' (and printed the
    piece), refused a bare IPv6 cluster node and checked 127.0.0.1 for ',a:7001'."""
    from kvmesh.services.cli.doctor_cmd import _host_port

    assert _host_port(scheme, rest) == first


def test_a_password_piece_cut_at_a_comma_is_hidden() -> None:
    url = "redis://u:s3cret,passw@h1:6379"
    assert "s3cret" not in redact_text("Port could not be cast: 's3cret'", url)
