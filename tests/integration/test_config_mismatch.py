"""A lookup-server configured with another chunk size than the engines (two services'
configs, so no config load can compare them): it asks each registered engine its
chunk size (the engine lookup protocol's Hello) and logs an error naming the worker.

Registration itself carries neither the chunk size nor the hash algorithm, so the
controller cannot refuse such a worker, and a hash algorithm mismatch goes unseen.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvtest.controller import CHUNK, ControllerProcess, build_engine
from kvtest.remote import free_port
from kvtest.service_process import KvmeshService
from kvtest.waiting import wait_for

from kvmesh.services.lookup.server import CHUNK_CHECK_S
from kvmesh.services.worker.lookup_server import attach_lookup_server

MISMATCH = "worker chunk size differs from lookup.chunk_size"


def lookup_process(workdir: Path, controller_url: str, chunk_size: int) -> KvmeshService:
    options = {"controller-url": controller_url, "chunk-size": chunk_size}
    return KvmeshService("lookup", workdir, free_port(), options)


def test_a_lookup_server_logs_engines_of_another_chunk_size(tmp_path: Path) -> None:
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    engine = other = same = None
    try:
        other = lookup_process(tmp_path, controller.url, 2 * CHUNK).start()
        same = lookup_process(tmp_path, controller.url, CHUNK).start()
        engine = build_engine("inst-a", controller.url)  # engine.chunk_size = CHUNK
        attach_lookup_server(engine, f"tcp://127.0.0.1:{free_port()}")

        def logged() -> bool:
            return MISMATCH in other.log.read_text(errors="replace")

        wait_for(logged, 3 * CHUNK_CHECK_S + 10, "the lookup-server logged the mismatch")
        text = other.log.read_text(errors="replace")
        line = next(line for line in text.splitlines() if MISMATCH in line)
        assert "inst-a/0" in line and f"engine_chunk_size={CHUNK}" in line, line
        assert f"lookup_chunk_size={2 * CHUNK}" in line, line
        # Asked once: one line, however many checks ran since.
        time.sleep(CHUNK_CHECK_S + 1)
        assert other.log.read_text(errors="replace").count(MISMATCH) == 1
        # The lookup-server that agrees with the engine has asked it by now too (its
        # checks run as often).
        assert MISMATCH not in same.log.read_text(errors="replace")
    finally:
        if engine is not None:
            engine.close()
        for service in (other, same):
            if service is not None:
                service.stop()
        controller.stop()
