"""Which backend gets the next request."""

from __future__ import annotations

from kvmesh.services.bridge.backends import Backend, BackendPool


def pool(n: int) -> BackendPool:
    return BackendPool([Backend("decoder", f"http://h{i}:1/") for i in range(n)])


def test_urls_lose_their_trailing_slash() -> None:
    assert pool(1).backends[0].url == "http://h0:1"


def test_idle_backends_take_turns() -> None:
    p = pool(3)
    picked = [p.pick(include_down=False).url for _ in range(6)]  # type: ignore[union-attr]
    assert picked == ["http://h0:1", "http://h1:1", "http://h2:1"] * 2


def test_the_least_loaded_backend_wins() -> None:
    p = pool(3)
    a, b, c = p.backends
    with a.busy(), a.busy(), b.busy():
        assert [p.pick(include_down=False) for _ in range(3)] == [c, c, c]
        with c.busy(), c.busy():
            assert p.pick(include_down=False) is b
    assert a.inflight == b.inflight == c.inflight == 0


def test_down_backends_are_skipped_unless_nothing_else_is_left() -> None:
    p = pool(2)
    a, b = p.backends
    a.mark(False, "refused")
    assert {p.pick(include_down=False) for _ in range(4)} == {b}
    b.mark(False, "refused")
    assert p.pick(include_down=False) is None
    assert p.pick(include_down=True) in (a, b)
    a.mark(True)
    assert p.pick(include_down=False) is a
    assert p.by_preference() == [a, b]
    assert p.any_up()


def test_empty_pool_picks_nothing() -> None:
    assert pool(0).pick(include_down=True) is None


def test_report_names_state_load_and_endpoints() -> None:
    d = Backend("decoder", "http://d:1", ["tcp://d:7650"])
    d.mark(False, "refused")
    report = d.report()
    assert report["state"] == "down" and report["error"] == "refused"
    assert report["kv_endpoints"] == ["tcp://d:7650"] and report["inflight"] == 0
    assert "kv_endpoints" not in Backend("prefiller", "http://p:1").report()
