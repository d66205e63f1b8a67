"""The Grafana dashboard k8s/kvmesh/dashboards/kvmesh.json against real services.

Every metric a panel queries must be one a running kvmesh process exports: the test
starts a controller, a lookup-server, a cache-server and a bridge (processes), and a
worker engine with every tier (in this process, serving its /metrics), scrapes each
/metrics page and compares names. A histogram is exported as its _bucket, _sum and
_count series, a counter as _total; a labelled metric with no series yet still has its
# TYPE line. The dashboard itself must be valid Grafana JSON: unique panel ids, every
panel on a Prometheus datasource, histogram_quantile only over _bucket series.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtest.bridge import BridgeProcess
from kvtest.controller import ControllerProcess
from kvtest.paged import make_cache
from kvtest.remote import CacheServerProcess
from kvtest.service_process import KvmeshService, free_port
from kvtest.waiting import wait_for

from kvmesh.common.config import EngineConfig, EngineControllerConfig, L1Config
from kvmesh.common.config.schema import DiskConfig, P2PConfig, RemoteConfig

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "kvmesh" / "dashboards" / "kvmesh.json"
METRIC = re.compile(r"\b(kvmesh_[a-zA-Z0-9_]+)\b")
TYPE_LINE = re.compile(r"^# TYPE (\S+) (\w+)$", re.MULTILINE)
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.MULTILINE)
SUFFIXES = {
    "counter": ("", "_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page exports or declares."""
    names = set(SAMPLE.findall(text))
    for name, kind in TYPE_LINE.findall(text):
        base = name.removesuffix("_total") if kind == "counter" else name
        names.update(base + s for s in SUFFIXES.get(kind, ("",)))
    return names


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> Iterator[dict]:
    for p in board["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows hold theirs


def expressions(board: dict) -> list[str]:
    """Every PromQL expression: the panels' and the template variables' queries."""
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    return exprs + [v["definition"] for v in board["templating"]["list"] if "definition" in v]


def sample_labels(text: str) -> dict[str, set[str]]:
    """series name -> the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for name, labels in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", text, re.M):
        out.setdefault(name, set()).update(re.findall(r'(\w+)="', labels))
    return out


@pytest.fixture(scope="module")
def metric_pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """service -> its /metrics text, every kvmesh process kind running."""
    from kvmesh.services.worker.engine import KVEngine

    tmp = tmp_path_factory.mktemp("dashboard")
    controller = ControllerProcess(tmp, snapshot=False)
    # The KV-event feed on: its metrics exist only then.
    controller.env["KVMESH_CONTROLLER__EVENTS_PORT"] = str(free_port())
    controller.env["KVMESH_CONTROLLER__EVENTS_REPLAY_PORT"] = str(free_port())
    controller.start()
    procs: list = [controller]
    engine = None
    try:
        cache = CacheServerProcess(tmp, metrics=True).start(60)
        procs.append(cache)
        lookup_metrics = free_port()
        lookup = KvmeshService(
            "lookup", tmp, free_port(),
            {"controller-url": controller.url, "metrics-port": lookup_metrics},
        ).start(60)  # fmt: skip
        procs.append(lookup)
        dead = f"http://127.0.0.1:{free_port()}"
        bridge = BridgeProcess(tmp, prefillers=[dead], decoders=[(dead, [])])
        bridge.start()
        procs.append(bridge)
        engine_metrics = free_port()
        view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
        (tmp / "disk").mkdir()
        cfg = EngineConfig(
            chunk_size=8,
            model_name="dashboard",
            metrics_port=engine_metrics,
            close_flush_s=0,
            l1=L1Config(max_size=8 << 20, reserve=0),
            disk=DiskConfig(enabled=True, path=str(tmp / "disk"), max_size=16 << 20),
            p2p=P2PConfig(enabled=True, channel="zmq"),
            remote=RemoteConfig(enabled=True, url=cache.url, health_interval_s=0.1),
            controller=EngineControllerConfig(enabled=True, url=controller.url),
        )
        engine = KVEngine("dash", 0, cfg, view)
        # One store, lookup and retrieve: the labelled series get their children.
        prompt = list(range(1000, 1032))
        engine.store(prompt, torch.arange(32))
        engine.lookup(prompt)
        engine.retrieve(prompt, torch.arange(32, 64))
        engine.lookup(list(range(5000, 5032)))  # a miss
        urls = {
            "controller": f"{controller.http}/metrics",
            "lookup": f"http://127.0.0.1:{lookup_metrics}/metrics",
            "cacheserver": f"http://127.0.0.1:{cache.metrics_port}/metrics",
            "bridge": f"{bridge.url}/metrics",
            "worker": f"http://127.0.0.1:{engine_metrics}/metrics",
        }
        # The controller counts the engine once it registered; the lookup-server's
        # index is in sync once it subscribed.
        wait_for(
            lambda: "kvmesh_controller_workers 1.0" in scrape(urls["controller"]),
            20,
            "the engine registered",
        )
        yield {name: scrape(url) for name, url in urls.items()}
    finally:
        if engine is not None:
            engine.close()
        for p in reversed(procs):
            p.stop()


def test_every_dashboard_metric_is_exported_by_a_running_service(metric_pages) -> None:
    exported = set().union(*(exported_names(t) for t in metric_pages.values()))
    for service, text in metric_pages.items():
        assert any(n.startswith("kvmesh_") for n in exported_names(text)), service
    used = {m for expr in expressions(dashboard()) for m in METRIC.findall(expr)}
    assert len(used) >= 30, sorted(used)
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics no service exports: {missing}"

    # Grouping labels exist on the series grouped (where the series has samples).
    labels: dict[str, set[str]] = {}
    for text in metric_pages.values():
        for name, found in sample_labels(text).items():
            labels.setdefault(name, set()).update(found)
    grouped = re.compile(r"(?:sum|min|max) by \(([^)]*)\) \((?:rate\()?(kvmesh_\w+)")
    checked = 0
    for expr in expressions(dashboard()):
        for by, metric in grouped.findall(expr):
            if metric in labels:
                want = {x.strip() for x in by.split(",")}
                assert want <= labels[metric], (metric, want, labels[metric])
                checked += 1
    assert checked >= 20, checked


def test_dashboard_json_is_generated_from_the_tool() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "k8s" / "tools" / "grafana_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    datasource_var = {v["name"] for v in board["templating"]["list"] if v["type"] == "datasource"}
    for p in panels(board):
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"].strip(), p["title"]
            # Every metric is a kvmesh one (vLLM's are not scraped by the chart).
            assert "vllm:" not in t["expr"], p["title"]
            for q in re.findall(r"histogram_quantile\(([^,]+),(.*)", t["expr"]):
                assert "_bucket" in q[1], (p["title"], t["expr"])
    assert datasource_var == {"datasource"}
