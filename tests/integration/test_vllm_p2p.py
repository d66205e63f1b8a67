"""The P2P tier end to end through two real vLLM processes and one controller.

vLLM instance A serves a prompt (its KV lands in A's L1, and A's events in the
controller's registry), then pauses while alive. Instance B, started meanwhile with an
empty cache and no tier in common with A but the controller, serves the same prompt:
its lookup finds A through the controller, it reads the three chunks from A's memory
over the P2P channel, and its output equals plain vLLM with the same 768 tokens cached
by vLLM's own prefix cache (`reference.split`). B's counters show the P2P hits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from kvtest.controller import ControllerProcess
from vllm_fixture import PROMPTS, Step, connector_config, run_session

from kvmesh.services.worker.vllm.testing import SessionError, SessionResult
from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

pytestmark = pytest.mark.timeout(900)

P = PROMPTS["p1000"]
CHUNK_TOKENS = 768  # three whole chunks of 256 of the 1000-token prompt
A_PAUSE_S = 300.0  # A stays alive this long at most; the test kills it sooner


def _pids_running(marker: str) -> list[int]:
    """Pids of this user's processes whose command line contains marker (A's spec)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if marker in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


class BackgroundSession:
    """run_session in a thread; `paused` is set when the child prints that step
    `pause_step` pauses. `kill()` SIGKILLs the child (found by its spec path)."""

    def __init__(
        self, model: Path, steps: list[Step], connector: dict, workdir: Path, pause_step: int
    ):
        self.workdir = workdir
        self.paused = threading.Event()
        self.result: SessionResult | None = None
        self.error: BaseException | None = None
        marker = f"kvmesh-session: step {pause_step} pausing"

        def progress(line: str) -> None:
            if line.startswith(marker):
                self.paused.set()

        def target() -> None:
            try:
                self.result = run_session(
                    model, steps, connector=connector, workdir=workdir, progress=progress
                )
            except BaseException as exc:  # reported by the test, not lost in the thread
                self.error = exc
            finally:
                self.paused.set()  # never leave the test waiting on a dead child

        self.thread = threading.Thread(target=target, name="vllm-a", daemon=True)
        self.thread.start()

    def wait_paused(self, timeout: float) -> None:
        assert self.paused.wait(timeout), "A did not reach its pause"
        if self.error is not None:
            raise AssertionError(f"A failed before its pause: {self.error}")

    def kill(self) -> None:
        for pid in _pids_running(str(self.workdir / "spec.json")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.thread.join(60)


def _workers(url: str) -> dict[str, dict[str, int]]:
    import asyncio

    from kvmesh.common.protocol import controller as proto
    from kvmesh.common.transport.controller_client import ControllerConnection

    async def ask() -> list[proto.WorkerInfo]:
        conn = ControllerConnection(url, timeout_s=5.0, client="test")
        try:
            await conn.connect()
            reply = await conn.request(proto.ListWorkers(conn.next_rid()), proto.ListWorkersReply)
            return reply.workers
        finally:
            await conn.close()

    return {w.instance_id: {**w.chunks, "p2p": bool(w.p2p_endpoint)} for w in asyncio.run(ask())}


def p2p_config(url: str, channel: str) -> dict:
    conn = connector_config(
        controller={"enabled": True, "url": url, "heartbeat_s": 0.5, "timeout_s": 5.0},
        # Two cores shared by two vLLMs: generous deadlines, so slowness is no miss.
        p2p={"enabled": True, "channel": channel, "timeout_s": 10.0, "lookup_timeout_s": 2.0},
    )
    return {**conn, "lookup_timeout_s": 5.0}  # the scheduler's deadline on B's lookup


@pytest.mark.parametrize("channel", ["zmq", "nixl"])
def test_b_pulls_a_prompt_from_a_memory(
    tiny_model: Path, reference, tmp_path: Path, channel: str
) -> None:
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    conn_a = p2p_config(controller.url, channel)
    conn_b = {**p2p_config(controller.url, channel), "instance_id": conn_a["instance_id"] + "-b"}
    other = prompt_tokens(300, seed=5)
    a = BackgroundSession(
        tiny_model,
        [Step(P), Step(other, pause_s=A_PAUSE_S)],
        conn_a,
        tmp_path / "a",
        pause_step=1,
    )
    try:
        a.wait_paused(600)
        # A stored P's three chunks in L1 and the controller knows (events flushed).
        deadline = time.monotonic() + 10
        while _workers(controller.url).get(conn_a["instance_id"], {}).get("l1", 0) < 3:
            assert time.monotonic() < deadline, _workers(controller.url)
            time.sleep(0.1)
        assert _workers(controller.url)[conn_a["instance_id"]]["p2p"]

        b = run_session(tiny_model, [Step(P)], connector=conn_b, workdir=tmp_path / "b")
    finally:
        a.kill()
        controller.stop()
    assert a.result is None and isinstance(a.error, SessionError)  # killed in its pause

    step = b.steps[0]
    assert step.hit_tokens == CHUNK_TOKENS
    assert step.num_cached_tokens == CHUNK_TOKENS
    assert step.logprobs[0] == reference.split("p1000", CHUNK_TOKENS).logprobs[0]
    assert step.output_tokens == reference.cold("p1000").output_tokens
    # Every loaded token came from A's memory: B had nothing else to load from.
    assert b.engine["tokens_hit_p2p"] >= CHUNK_TOKENS
    assert b.engine["p2p_gets_hit"] >= 3
    assert b.engine["p2p_gets_corrupt"] == 0
    assert b.engine["p2p_received_bytes"] > 0
    assert b.engine["load_errors"] == 0
