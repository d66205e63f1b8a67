"""The metrics the docs name are the metrics the services export, checked mechanically.

Every kvmesh process that serves /metrics is started for real (controller with its
KV-event feed, lookup-server, cache-server, bridge, and a worker engine with every
built-in tier, PD both ways and its lookup endpoint) and scraped over HTTP. The docs
(docs/operations.md, docs/deployment.md for the bridge and PD, docs/troubleshooting.md)
are parsed for the metric names they give: in a `| metric |` table, a `kvmesh_...`
name anywhere, or a name relative to a `kvmesh_<service>_*` prefix the text
announced. Then:

- every family a process exports is documented (a new metric needs its line);
- every documented name is exported by one of them (a rename needs its doc fixed);
- where a table gives the type or the labels, they are the exported ones.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from kvtest.bridge import BridgeProcess
from kvtest.controller import ControllerProcess
from kvtest.http_backend import HttpBackend
from kvtest.paged import make_cache
from kvtest.remote import CacheServerProcess
from kvtest.service_process import KvmeshService, free_port
from kvtest.waiting import wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.common.config import (
    DiskConfig,
    EngineConfig,
    EngineControllerConfig,
    L1Config,
    P2PConfig,
    PDConfig,
    RemoteConfig,
)

REPO = Path(__file__).resolve().parents[2]
DOCS = tuple(REPO / "docs" / f for f in ("operations.md", "deployment.md", "troubleshooting.md"))
# Labels every series of a process carries (the engine's instance and rank, the
# lookup-server's service), documented once per section rather than per metric.
CONST_LABELS = frozenset(("instance", "rank", "service"))
TOKEN = re.compile(r"`([a-z][a-z0-9_]*)(\{[^}`]*\})?`")
PREFIX = re.compile(r"`(kvmesh_[a-z0-9]+_)\*`")
METRIC_SUFFIXES = ("_total", "_seconds", "_bytes")


@dataclass
class Documented:
    """What the docs say of one metric: where, and the type and labels when a table
    says them (None: not said)."""

    where: list[str] = field(default_factory=list)
    type: str | None = None
    labels: set[str] | None = None


def _label_names(text: str) -> set[str]:
    """`{a, b}` or `{tier="disk"}` -> the label names."""
    inner = text.strip("{}")
    return {part.split("=")[0].strip() for part in inner.split(",") if part.strip()}


def _full(name: str, prefix: str) -> str:
    if name.startswith("kvmesh_"):
        return name
    if prefix and not name.startswith(prefix.removeprefix("kvmesh_")):
        return prefix + name
    return "kvmesh_" + name


def parse_docs(paths: tuple[Path, ...] = DOCS) -> dict[str, Documented]:
    found: dict[str, Documented] = {}

    def note(name: str, where: str) -> Documented:
        doc = found.setdefault(name, Documented())
        doc.where.append(where)
        return doc

    for path in paths:
        prefix = ""
        columns: list[str] = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.name}:{n}"
            if line.startswith("#") or line.startswith("- **"):
                prefix = ""
            if m := PREFIX.search(line):
                prefix = m.group(1)
            if not line.startswith("|"):
                columns = []
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| metric |"):
                columns = cells
                continue
            if columns and cells and not set(cells[0]) <= {"-"}:
                row = dict(zip(columns, cells, strict=False))
                for name, braces in TOKEN.findall(row["metric"]):
                    doc = note(_full(name, prefix), where)
                    if "type" in row:
                        doc.type = row["type"]
                    if "labels" in row:
                        doc.labels = set(re.findall(r"`([a-z_]+)[`=]", row["labels"]))
                    if braces:
                        doc.labels = _label_names(braces)
                continue
            for name, braces in TOKEN.findall(line):
                relative = prefix and (braces or name.endswith(METRIC_SUFFIXES))
                if (name.startswith("kvmesh_") and name != "kvmesh_") or relative:
                    doc = note(_full(name, prefix), where)
                    if braces and "=" not in braces and doc.labels is None:
                        doc.labels = _label_names(braces)
    return found


@dataclass
class Exported:
    type: str
    labels: set[str]
    sampled: bool
    process: str


def scrape(url: str, process: str) -> dict[str, Exported]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, Exported] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation times, one per counter/histogram
        name = family.name + ("_total" if family.type == "counter" else "")
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - CONST_LABELS - {"le"}
        out[name] = Exported(family.type, labels, bool(family.samples), process)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Iterator[dict[str, Exported]]:
    from kvmesh.services.worker.engine import KVEngine
    from kvmesh.services.worker.engine_health import engine_health
    from kvmesh.services.worker.lookup_server import attach_lookup_server

    tmp = tmp_path_factory.mktemp("obs")
    started: list = []
    backend = HttpBackend().start()
    eng = None
    try:
        ctl = ControllerProcess(tmp, snapshot=True, events=True).start()
        started.append(ctl)
        lookup_metrics = free_port()
        lookup = KvmeshService(
            "lookup",
            tmp,
            free_port(),
            {"controller-url": ctl.url, "chunk-size": 8, "metrics-port": lookup_metrics},
        ).start(60)
        started.append(lookup)
        cache = CacheServerProcess(tmp, metrics=True).start(60)
        started.append(cache)
        bridge = BridgeProcess(tmp, prefillers=[backend.url], decoders=[(backend.url, [])])
        bridge.launch()
        started.append(bridge)
        bridge.wait_ready()

        view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
        engine_metrics = free_port()
        cfg = EngineConfig(
            chunk_size=8,
            model_name="obs",
            l1=L1Config(max_size=8 << 20, reserve=0),
            disk=DiskConfig(enabled=True, path=str(tmp / "disk"), max_size=64 << 20),
            remote=RemoteConfig(enabled=True, url=cache.url, health_interval_s=0.1),
            p2p=P2PConfig(enabled=True, channel="zmq"),
            pd=PDConfig(role="both"),
            controller=EngineControllerConfig(enabled=True, url=ctl.url, heartbeat_s=0.2),
            metrics_port=engine_metrics,
        )
        eng = KVEngine("obs", 0, cfg, view)
        attach_lookup_server(eng, f"ipc://{tmp}/lookup.sock")
        wait_for(lambda: engine_health(eng).status == "ok", timeout=20, what="engine healthy")
        # A lookup, a store and a load, so that labelled families have children.
        toks = list(range(64))
        eng.store(toks, torch.arange(64))
        eng.lookup(toks)
        eng.retrieve(toks, torch.arange(64))
        time.sleep(0.3)

        found: dict[str, Exported] = {}
        for process, url in (
            ("controller", ctl.http + "/metrics"),
            ("lookup", f"http://127.0.0.1:{lookup_metrics}/metrics"),
            ("cacheserver", f"http://127.0.0.1:{cache.metrics_port}/metrics"),
            ("bridge", bridge.url + "/metrics"),
            ("engine", f"http://127.0.0.1:{engine_metrics}/metrics"),
        ):
            for name, what in scrape(url, process).items():
                # The engine's tiers and the services never share a family name.
                assert name not in found or found[name].type == what.type, name
                found.setdefault(name, what)
        yield found
    finally:
        if eng is not None:
            eng.close()
        for proc in reversed(started):
            proc.stop()
        backend.stop()


def test_every_exported_metric_is_documented(exported: dict[str, Exported]) -> None:
    documented = parse_docs()
    missing = sorted(
        f"{name} ({what.process})" for name, what in exported.items() if name not in documented
    )
    assert not missing, f"exported but not in the docs: {missing}"


def test_every_documented_metric_is_exported(exported: dict[str, Exported]) -> None:
    documented = parse_docs()
    stale = sorted(
        f"{name} ({', '.join(doc.where)})"
        for name, doc in documented.items()
        if name not in exported
    )
    assert not stale, f"in the docs but exported by no process: {stale}"


def test_documented_types_and_labels_are_the_exported_ones(
    exported: dict[str, Exported],
) -> None:
    wrong = []
    for name, doc in parse_docs().items():
        what = exported.get(name)
        if what is None:
            continue
        if doc.type is not None and doc.type != what.type:
            wrong.append(f"{name}: documented {doc.type}, exported {what.type} ({doc.where})")
        if doc.labels is not None and what.sampled and doc.labels != what.labels:
            wrong.append(
                f"{name}: documented labels {sorted(doc.labels)}, exported "
                f"{sorted(what.labels)} ({doc.where})"
            )
    assert not wrong, "\n".join(wrong)


def test_the_doc_parser_finds_each_kind_of_entry() -> None:
    """The checks above are only as good as the parser: a typed table row, a relative
    name under a prefix, a braced name and prose names must all be found."""
    docs = parse_docs()
    assert docs["kvmesh_disk_io_seconds"].type == "histogram"
    assert docs["kvmesh_disk_io_seconds"].labels == {"op"}
    assert docs["kvmesh_cacheserver_requests_total"].labels == {"listener", "op"}
    assert docs["kvmesh_p2p_gets_total"].labels == {"result"}
    assert docs["kvmesh_lookup_index_in_sync"].where
    assert docs["kvmesh_bridge_backend_up"].labels == {"role", "backend"}
    assert docs["kvmesh_pd_receive_pages"].where
    assert len(docs) > 100


def _get_json(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, json.loads(resp.read())


def test_engine_health_reports_a_stalled_event_loop_and_recovers(tmp_path) -> None:
    """The engine's loop runs every tier's I/O and the controller session. Stalled
    (a blocking call on it), every load times out and the controller drops the
    worker, yet each flag the report read still said ok and registered: /health
    must say degraded while the stall lasts, answer at once meanwhile, and say ok
    again after it."""
    from kvmesh.services.worker.engine import KVEngine
    from kvmesh.services.worker.engine_health import LOOP_STALL_S

    view, _, _ = make_cache("cpu", torch.float16, True, blocks=4, block_size=4)
    port = free_port()
    cfg = EngineConfig(chunk_size=8, l1=L1Config(max_size=4 << 20, reserve=0), metrics_port=port)
    eng = KVEngine("stall", 0, cfg, view)
    url = f"http://127.0.0.1:{port}/health"
    try:
        status, body = _get_json(url)
        assert (status, body["status"]) == (200, "ok")

        stall_s = LOOP_STALL_S + 4.0

        async def block() -> None:
            time.sleep(stall_s)  # noqa: ASYNC251 -- the blocking call under test

        eng.loop.submit(block())
        t0 = time.monotonic()
        seen = None
        while time.monotonic() - t0 < stall_s - 0.5:
            asked = time.monotonic()
            status, body = _get_json(url)
            assert time.monotonic() - asked < 1.0, "the probe waited on the stalled loop"
            assert status == 200  # degraded, never a failed liveness probe
            if body["status"] == "degraded":
                seen = body
                break
            time.sleep(0.2)
        assert seen is not None, "a stalled loop was reported ok"
        assert seen["loop"] == {"running": True, "stalled_s": seen["loop"]["stalled_s"]}
        assert seen["loop"]["stalled_s"] > LOOP_STALL_S
        assert any("event loop" in p for p in seen["problems"]), seen["problems"]

        wait_for(lambda: _get_json(url)[1]["status"] == "ok", timeout=stall_s + 5, what="ok")
        assert _get_json(url)[1]["loop"]["stalled_s"] < LOOP_STALL_S
    finally:
        eng.close()


def test_library_log_lines_are_json_too(tmp_path) -> None:
    """With logging.json (the default) every line of a service's stream is one JSON
    object, the documented `jq` pipeline included. Records of libraries that log
    through the standard module (aiohttp's at debug: a bad request's traceback)
    came out as plain "name LEVEL message" text with the traceback on lines of its
    own, and jq stopped at the first of them."""
    metrics_port = free_port()
    svc = KvmeshService(
        "cacheserver",
        tmp_path,
        free_port(),
        {"max-memory": "64MiB", "max-value-size": "1MiB", "metrics-port": metrics_port},
    )
    svc.env.update({"KVMESH_LOGGING__JSON": "true", "KVMESH_LOGGING__LEVEL": "debug"})
    with svc.start(60):
        for request in (
            b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
            b"GARBAGE\xff\xfe\n\n\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", metrics_port), timeout=5) as sock:
                sock.sendall(request)
                assert sock.recv(100).startswith(b"HTTP/1.0 400")
        # The lines are written as the requests are answered; the stop flushes.
        time.sleep(0.2)
    lines = svc.log.read_bytes().splitlines()
    parsed, broken = [], []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            broken.append(line)
    assert not broken, broken[:5]
    aiohttp_lines = [p for p in parsed if p.get("logger_name") == "aiohttp.server"]
    assert aiohttp_lines, "the bad requests were not logged (debug)"
    for p in aiohttp_lines:
        assert p["service"] == "cacheserver" and p["level"] == "debug" and "timestamp" in p
