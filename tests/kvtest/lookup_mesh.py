"""The mesh of the fault tests with a lookup-server in it (tests/integration/
test_mesh_faults_lookup.py): engines serving their lookup endpoints
(kvtest.lookup_mesh_node), `kvmesh serve lookup` following the controller's index, and
a scheduler-like client doing lookups on a thread of its own while a test injects
faults. Every lookup is timed and kept, so a test can check each answer against
what the engines were told to hold."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.common.transport.lookup_service_client import (
    LookupServiceClient,
    LookupServiceError,
    LookupServiceUnavailable,
)
from kvtest.mesh_node import CHUNK
from kvtest.mesh_node import prompt_tokens as prompt_tokens
from kvtest.prom import sample_sum
from kvtest.service_process import KvmeshService, KvtestProcess, free_port


class LookupServer(KvmeshService):
    """`kvmesh serve lookup` on a fixed port (a restart keeps the clients' address)."""

    def __init__(self, workdir: Path, controller_url: str, worker_timeout_s: float) -> None:
        options = {
            "controller-url": controller_url,
            "chunk-size": CHUNK,
            "worker-timeout-s": worker_timeout_s,
            "controller-timeout-s": worker_timeout_s,
            "metrics-port": free_port(),
        }
        self.metrics_port = options["metrics-port"]
        super().__init__("lookup", workdir, free_port(), options)

    def health(self) -> dict:
        """Its /health (the index follower's state under "index")."""
        url = f"http://127.0.0.1:{self.metrics_port}/health"
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return json.loads(r.read())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of name's samples with these labels on its /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return sample_sum(r.read().decode(), name, **labels)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


class LookupNode(KvtestProcess):
    """One engine process (kvtest.lookup_mesh_node) taking JSON commands; its lookup
    endpoint is fixed, so a restarted node registers the same one."""

    def __init__(self, tmp: Path, name: str, cfg: dict) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        cfg = {"name": name, "lookup_endpoint": self.endpoint, **cfg}
        super().__init__(
            f"node {name}",
            "lookup_mesh_node",
            [json.dumps(cfg)],
            log=tmp / f"lookup-node-{name}.log",
            ready_line="{",
        )


@dataclass
class Answer:
    t: float  # monotonic time the lookup was sent
    took: float
    instance: str
    seed: int
    hit: int | None  # None: no answer (error or no reply)
    error: str = ""
    lookup_id: str = ""


@dataclass
class LookupLoad:
    """Lookups one after another from a thread of its own: each of an instance's
    prompts, held or not, some pinned under a lookup id (half of those released, the
    others left to expire)."""

    url: str
    deadline_s: float
    prompts: dict[str, list[int]]  # instance -> seeds to ask about
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> LookupLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Answer]:
        assert self._thread is not None
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the lookup client hung"
        return self.answers

    def since(self, t: float) -> list[Answer]:
        return [a for a in list(self.answers) if a.t >= t]

    async def _run(self) -> None:
        rng = random.Random(7)
        n = 0
        async with LookupServiceClient(self.url, timeout_s=self.deadline_s, name="sched") as c:
            while not self._stop.is_set():
                n += 1
                instance = rng.choice(sorted(self.prompts))
                seed = rng.choice(self.prompts[instance])
                pin = rng.random() < 0.5
                lookup_id = f"load-{n}" if pin else ""
                t0 = time.monotonic()
                hit, error = None, ""
                try:
                    reply = await c.lookup(
                        instance, prompt_tokens(seed), lookup_id=lookup_id, pin=pin
                    )
                    hit = reply.hit_tokens
                except (LookupServiceError, LookupServiceUnavailable) as exc:
                    error = repr(exc)
                took = time.monotonic() - t0
                self.answers.append(Answer(t0, took, instance, seed, hit, error, lookup_id))
                if pin and n % 2 == 0:
                    # Not released: its pins expire on the engine.
                    with contextlib.suppress(LookupServiceError, LookupServiceUnavailable):
                        await c.release(instance, lookup_id)
                await asyncio.sleep(0.005)
