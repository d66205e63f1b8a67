"""The namespace's model name for a vLLM instance, from vLLM's own ModelConfig: the
settings that change the KV the same weights compute change the name; the others
leave it alone."""

from __future__ import annotations

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


def test_hf_overrides_change_the_name_by_their_content(path: str) -> None:
    one = model_identity(ModelConfig(model=path, hf_overrides=ROPE))
    same = model_identity(
        ModelConfig(
            model=path,
            hf_overrides={"rope_parameters": dict(reversed(ROPE["rope_parameters"].items()))},
        )
    )
    other = model_identity(
        ModelConfig(
            model=path,
            hf_overrides={"rope_parameters": {"rope_theta": 60000.0, "rope_type": "default"}},
        )
    )
    assert one.startswith(f"{path}+hf_overrides=") and one != path
    assert same == one  # key order is not content
    assert other not in (one, path)


def test_a_configured_name_stands_for_the_path_only(path: str) -> None:
    assert model_identity(ModelConfig(model=path), "llama-3-8b") == "llama-3-8b"
    quantized = ModelConfig(model=path, quantization="fp8")
    assert model_identity(quantized, "llama-3-8b") == "llama-3-8b+quantization=fp8"
