"""Pooling (embedding) models through the connector, in real vLLM on CPU: kvmesh serves
them only where vLLM's own prefix cache would. LAST-token pooling reuses a stored
prefix and embeds exactly as cold; MEAN pooling needs every prompt token computed, so
the connector refuses it at start (before, vLLM crashed on the first load). vLLM's own
prefix cache is off, so a prefix reused is kvmesh's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.services.worker.vllm.testing import connector_config, vllm_env

pytestmark = pytest.mark.timeout(600)

CHILD = """
import json, sys
from vllm import LLM
from vllm.config import KVTransferConfig, PoolerConfig
from vllm.inputs import TokensPrompt
from kvmesh.services.worker.vllm.tiny_model import prompt_tokens
model, pooling, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kv = KVTransferConfig(
    kv_connector="KvmeshConnector",
    kv_connector_module_path="kvmesh.services.worker.vllm.connector",
    kv_role="kv_both",
    kv_load_failure_policy="recompute",
    kv_connector_extra_config=extra,
)
try:
    llm = LLM(model=model, runner="pooling", pooler_config=PoolerConfig(seq_pooling_type=pooling),
              kv_transfer_config=kv, dtype="float32", enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=False)
except ValueError as e:
    print("RESULT " + json.dumps({"refused": str(e)}))
    sys.exit(0)
prompt = TokensPrompt(prompt_token_ids=prompt_tokens(1000, seed=1))
runs = [llm.embed([prompt])[0] for _ in range(2)]
print("RESULT " + json.dumps({
    "cached": [r.num_cached_tokens for r in runs],
    "embeddings": [r.outputs.embedding for r in runs],
}))
"""


def embed_twice(model: Path, pooling: str, tmp_path: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), pooling, json.dumps(connector_config())],
        env=vllm_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout + run.stderr)[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_last_token_pooling_reuses_the_prefix_and_embeds_as_cold(tiny_model, tmp_path) -> None:
    out = embed_twice(tiny_model, "LAST", tmp_path)
    assert out["cached"] == [0, 768]  # the second request loaded three chunks
    cold, warm = out["embeddings"]
    assert len(cold) > 0 and warm == pytest.approx(cold, abs=1e-5)


def test_mean_pooling_is_refused_at_start_naming_why(tiny_model, tmp_path) -> None:
    out = embed_twice(tiny_model, "MEAN", tmp_path)
    assert "does not support prefix caching" in out["refused"]
    assert "MEAN" in out["refused"]
