"""The namespace's model name for a vLLM instance, from vLLM's own ModelConfig: the
settings that change the KV the same weights compute change the name; the others
leave it alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config import ModelConfig

from kvmesh.services.worker.vllm.model_identity import model_identity
from kvmesh.services.worker.vllm.tiny_model import TinyModelSpec, build_tiny_model

ROPE = {"rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}


@pytest.fixture(scope="module")
def path() -> str:
    return str(build_tiny_model(TinyModelSpec()))


def test_plain_weights_are_named_by_their_path(path: str) -> None:
    assert model_identity(ModelConfig(model=path)) == path
    # What only vLLM's scheduling or memory sees keeps the name.
    assert model_identity(ModelConfig(model=path, max_model_len=1024, seed=7)) == path


def test_quantization_at_load_changes_the_name(path: str) -> None:
    name = model_identity(ModelConfig(model=path, quantization="fp8"))
    assert name == f"{path}+quantization=fp8"


def test_the_config_run_names_the_variant_however_it_was_given(path: str, tmp_path) -> None:
    """hf_overrides (a dict or a function) and hf_config_path are named by the config
    vLLM then runs: the same config, the same name; another, another."""

    def same_rope(config):
        config.rope_parameters = dict(ROPE["rope_parameters"])
        return config

    def named(**kwargs) -> str:
        return model_identity(ModelConfig(model=path, **kwargs))

    one = named(hf_overrides=ROPE)
    assert one.startswith(f"{path}+config=") and one != path
    reordered = {"rope_parameters": dict(reversed(ROPE["rope_parameters"].items()))}
    assert named(hf_overrides=reordered) == one  # key order is not content
    assert named(hf_overrides=same_rope) == one  # a function with the same effect
    other = {"rope_parameters": {"rope_theta": 60000.0, "rope_type": "default"}}
    assert named(hf_overrides=other) not in (one, path)
    assert named(hf_overrides=lambda c: c) not in (one, path)  # flagged, its own name
    # Another config file for the same weights.
    alt = tmp_path / "alt"
    alt.mkdir()
    config = json.loads((Path(path) / "config.json").read_text())
    config["rope_parameters"] = dict(ROPE["rope_parameters"])
    (alt / "config.json").write_text(json.dumps(config))
    assert named(hf_config_path=str(alt)) == one


def test_a_checkpoints_own_quantization_is_named_by_its_path() -> None:
    """vLLM reports a quantized checkpoint's method too (its spelling differs by
    platform: awq on CPU, auto_awq on GPU); the path names those weights already."""
    checkpoint = SimpleNamespace(
        model="/models/llama-awq",
        revision=None,
        quantization="awq",
        quantization_config=None,
        hf_config=SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 4}),
    )
    assert model_identity(checkpoint) == "/models/llama-awq"
    # Online quantization composed over it (vLLM may quantize the layers the checkpoint
    # left in bf16, attention included) is named.
    composed = SimpleNamespace(**{**vars(checkpoint), "quantization_config": {"linear": "fp8"}})
    assert model_identity(composed).startswith("/models/llama-awq+quantization_config=")


def test_a_configured_name_stands_for_the_path_only(path: str) -> None:
    assert model_identity(ModelConfig(model=path), "llama-3-8b") == "llama-3-8b"
    quantized = ModelConfig(model=path, quantization="fp8")
    assert model_identity(quantized, "llama-3-8b") == "llama-3-8b+quantization=fp8"


HUB_SCRIPT = """
import json, sys
from pathlib import Path
from vllm.engine.arg_utils import EngineArgs
from vllm.config import ModelConfig
from kvmesh.services.worker.vllm.model_identity import model_identity
refs = Path(sys.argv[1]) / "models--kvmesh-test--tiny" / "refs"
# As vLLM builds it when serving (offline, it swaps the id for the snapshot's path).
served = EngineArgs(model="kvmesh-test/tiny").create_model_config()
plain = ModelConfig(model="kvmesh-test/tiny")
names = [model_identity(served), model_identity(plain)]
(refs / "main").write_text(sys.argv[3])  # the branch moved: a newer download
# Configs built before the move name the files they were built from.
names += [model_identity(served), model_identity(plain)]
names.append(model_identity(ModelConfig(model="kvmesh-test/tiny")))
names.append(model_identity(ModelConfig(model="kvmesh-test/tiny", revision="v1")))
print(json.dumps(names))
"""


def test_a_hub_id_is_pinned_to_the_commit_its_files_came_from(path: str, tmp_path) -> None:
    """vLLM loads a hub id from the host's Hugging Face cache (offline here): the name
    carries the commit the branch or tag points to, so two hosts with different
    downloads of `main` never share chunks."""
    repo = tmp_path / "hub" / "models--kvmesh-test--tiny"
    old, new = "a" * 40, "b" * 40
    for commit in (old, new):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in Path(path).iterdir():
            (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(old)
    (repo / "refs" / "v1").write_text(old)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT, str(tmp_path / "hub"), old, new],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    names = json.loads(run.stdout.strip().splitlines()[-1])
    hub = "kvmesh-test/tiny"
    assert names == [f"{hub}@{c}" for c in (old, old, old, old, new, old)]
