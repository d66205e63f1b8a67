"""The tiny model (services/worker/vllm/tiny_model.py) is readable by every user once
built, whatever the builder's umask: one model cache serves services run as others."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvmesh.services.worker.vllm.tiny_model import TinyModelSpec, build_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=64, num_layers=1, vocab_size=512)


def test_a_built_model_is_0755_with_0644_files_under_a_strict_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)  # what a locked-down builder has: its files would be 0600
    try:
        path = build_tiny_model(SPEC, tmp_path)
    finally:
        os.umask(old)
    modes = {".": stat.S_IMODE(path.stat().st_mode)}
    want = {".": 0o755}
    for dirpath, dirs, files in os.walk(path):
        for name, mode in [*((d, 0o755) for d in dirs), *((f, 0o644) for f in files)]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            modes[rel], want[rel] = stat.S_IMODE(os.stat(full).st_mode), mode
    assert {"config.json", "kvmesh-tiny-model.json"} <= modes.keys()
    assert any(n.endswith(".safetensors") for n in modes)
    assert {n: oct(m) for n, m in modes.items()} == {n: oct(m) for n, m in want.items()}
    assert build_tiny_model(SPEC, tmp_path) == path  # found again, not rebuilt
