"""Serve prompts in real vLLM processes on CPU, with or without kvmesh: for tests,
`kvmesh demo` and benchmarks.

    model = build_tiny_model()                       # tiny_model.py; cached on disk
    prompt = prompt_tokens(1000, seed=1)
    cold = run_session(model, [Step(prompt)])        # no connector: the reference
    warm = run_session(model, [Step(prompt), Step(prompt)],
                       connector=connector_config(l1_size="256MiB"))
    warm.steps[1].hit_tokens                         # 768
    warm.steps[1].logprobs[0] == cold.steps[0].logprobs[0]

Each `run_session` is one fresh process (`python -m kvmesh.services.worker.vllm.session`)
that starts vLLM (`enforce_eager=True`, vLLM's prefix cache off, so reuse can only
come from kvmesh), warms it up with an unrelated prompt, serves the steps in order,
one request at a time, and exits. `serve_twice` is "serve P in process A, then in a
fresh process B": what B finds comes from a tier that outlives a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.services.worker.vllm.tiny_model import build_tiny_model, prompt_tokens

__all__ = [
    "SessionError",
    "SessionResult",
    "Step",
    "StepResult",
    "build_tiny_model",
    "connector_config",
    "prompt_tokens",
    "run_session",
    "serve_twice",
    "vllm_env",
]


class SessionError(RuntimeError):
    """The vLLM process failed or timed out; the message ends with its output."""


@dataclass
class Step:
    """One request: prompt token ids, then max_tokens generated greedily.

    drop: "last" or "all" removes that many of the request's cached chunks from the
    engine just before its load (as if evicted after the lookup): vLLM must
    recompute them. Needs a connector.
    pause_s: before the request, the child prints `kvmesh-session: step I pausing` and
    waits that long: a test that watches the output (run_session's progress) can act at
    that point, e.g. kill a service the step depends on.
    """

    tokens: list[int]
    max_tokens: int = 1
    logprobs: int = 5
    kv_transfer_params: dict[str, Any] | None = None
    drop: str | None = None
    pause_s: float = 0.0
    cache_salt: str | None = None  # vLLM's own prefix cache shares blocks per salt


@dataclass
class StepResult:
    output_tokens: list[int]
    logprobs: list[dict[int, float]]  # per generated token: top token id → logprob
    num_cached_tokens: int  # vLLM's count of prompt tokens not computed
    kvmesh: dict[str, int] | None  # {"hit_tokens", "saved_tokens"} from the connector
    seconds: float  # wall time of the request; its TTFT when max_tokens == 1

    @property
    def hit_tokens(self) -> int:
        return (self.kvmesh or {}).get("hit_tokens", 0)


@dataclass
class SessionResult:
    startup_s: float
    steps: list[StepResult]
    engine: dict[str, float] = field(default_factory=dict)  # rank 0's kvmesh counters
    events: dict[str, int] = field(default_factory=dict)  # KV events vLLM got, by type
    log: str = ""


def connector_config(
    *,
    l1_size: str = "256MiB",
    layerwise: bool = False,
    chunk_size: int = 256,
    instance_id: str | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """kv_connector_extra_config for a session: an L1 of l1_size (no reserve), plus any
    other `engine` keys (e.g. disk={"enabled": True, "path": ...})."""
    l1 = {"max_size": l1_size, "reserve": 0, **engine.pop("l1", {})}
    return {
        "instance_id": instance_id or f"t-{uuid.uuid4().hex[:12]}",
        "config": {
            "engine": {"chunk_size": chunk_size, "layerwise": layerwise, "l1": l1, **engine}
        },
    }


def vllm_env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM child on CPU: offline, its own caches under workdir."""
    env = dict(os.environ)
    ipc = Path(tempfile.mkdtemp(prefix="kvm-", dir="/tmp"))
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
            "VLLM_RPC_BASE_PATH": str(workdir),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "KVMESH_IPC_DIR": str(ipc),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def run_session(
    model: Path | str,
    steps: list[Step],
    *,
    connector: dict[str, Any] | None = None,
    dtype: str = "float32",
    kv_role: str = "kv_both",
    max_model_len: int = 4096,
    llm_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    workdir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> SessionResult:
    """Serve steps in one fresh vLLM process.

    connector: kv_connector_extra_config (see connector_config), or None for plain
    vLLM. llm_kwargs: more arguments of vllm.LLM. env: more environment variables of
    the child. workdir: where its spec, result and log (vllm.log) go; by default a
    temporary directory, removed afterwards (a SessionError carries the log's tail).
    progress: called with each line the child prints (vLLM's start-up log), as it
    prints it.
    """
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvmesh-vllm-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "dtype": dtype,
        "connector": connector,
        "kv_role": kv_role,
        "max_model_len": max_model_len,
        "llm_kwargs": llm_kwargs or {},
        "steps": [s.__dict__ for s in steps],
    }
    spec_path, out_path, log_path = work / "spec.json", work / "result.json", work / "vllm.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    child_env = vllm_env(work, env)
    cmd = [sys.executable, "-m", "kvmesh.services.worker.vllm.session", str(spec_path)]
    cmd.append(str(out_path))
    try:
        try:
            returncode = _run_child(cmd, child_env, log_path, timeout_s, progress)
        finally:
            _remove_tree(Path(child_env["KVMESH_IPC_DIR"]))
        if returncode is None:
            raise SessionError(f"vLLM session timed out after {timeout_s}s\n{_tail(log_path)}")
        if returncode != 0 or not out_path.exists():
            raise SessionError(f"vLLM session exited with {returncode}\n{_tail(log_path)}")
        return _result(json.loads(out_path.read_text()), log_path.read_text(errors="replace"))
    finally:
        if own:
            _remove_tree(work)


def _result(raw: dict[str, Any], log: str) -> SessionResult:
    return SessionResult(
        startup_s=raw["startup_s"],
        steps=[
            StepResult(
                output_tokens=s["output_tokens"],
                logprobs=[{int(k): v for k, v in pos.items()} for pos in s["logprobs"]],
                num_cached_tokens=s["num_cached_tokens"],
                kvmesh=s["kvmesh"],
                seconds=s["seconds"],
            )
            for s in raw["steps"]
        ],
        engine=raw["engine"],
        events=raw.get("events", {}),
        log=log,
    )


def serve_twice(
    model: Path | str,
    steps: list[Step],
    connector_a: dict[str, Any] | None,
    connector_b: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[SessionResult, SessionResult]:
    """Serve steps in vLLM process A, then the same steps in a fresh process B.

    connector_b defaults to connector_a with a new instance id (a new vLLM instance
    on the same host, sharing whatever tiers the config names)."""
    if connector_b is None and connector_a is not None:
        connector_b = {**connector_a, "instance_id": f"t-{uuid.uuid4().hex[:12]}"}
    a = run_session(model, steps, connector=connector_a, **kwargs)
    b = run_session(model, steps, connector=connector_b, **kwargs)
    return a, b


def _run_child(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
    progress: Callable[[str], None] | None,
) -> int | None:
    """Run cmd with its output in log_path (and passed to progress line by line); its
    exit status, or None if it was killed at the timeout."""
    deadline = time.monotonic() + timeout_s
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if progress is not None:
                    progress(line.decode(errors="replace").rstrip("\n"))
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if time.monotonic() >= deadline and proc.returncode != 0:
        return None
    return proc.returncode


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
