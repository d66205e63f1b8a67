"""Fixtures for end-to-end tests through a real vLLM on CPU (import them into a test
module: `from vllm_fixture import *`).

- `tiny_model`: the tiny random Llama and its tokenizer, built once and cached under
  $KVMESH_MODELS_DIR (default ~/.cache/kvmesh/models), so later runs start at once.
- `reference`: what plain vLLM (no connector) answers for each prompt of PROMPTS: the
  outputs a run through kvmesh must reproduce exactly.
- `serve_a_then_b`: "serve these requests in vLLM process A, then in a fresh vLLM
  process B" with a kvmesh config per process. Tiers that outlive a process (disk,
  remote, peers) add their cases with it:

      a, b = serve_a_then_b([Step(PROMPTS["p1000"])], connector_config(disk={...}))
      assert b.steps[0].hit_tokens >= 768

Every vLLM process costs ~15-30 s of start-up on 2 cores: put the requests of one
scenario in one session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmesh.services.worker.vllm.testing import (
    SessionResult,
    Step,
    StepResult,
    connector_config,
    run_session,
    serve_twice,
)
from kvmesh.services.worker.vllm.tiny_model import TinyModelSpec, build_tiny_model, prompt_tokens

__all__ = [
    "PROMPTS",
    "Step",
    "connector_config",
    "reference",
    "run_session",
    "serve_a_then_b",
    "tiny_model",
]

_P1000 = prompt_tokens(1000, seed=1)
PROMPTS: dict[str, list[int]] = {
    "p1000": _P1000,
    # shares only its first 600 tokens with p1000: two whole chunks of 256
    "p600": _P1000[:600] + prompt_tokens(400, seed=2),
}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model(TinyModelSpec())


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> dict[str, StepResult]:
    names = list(PROMPTS)
    result = run_session(tiny_model, [Step(PROMPTS[n]) for n in names])
    return dict(zip(names, result.steps, strict=True))


@pytest.fixture
def serve_a_then_b(
    tiny_model: Path,
) -> Callable[..., tuple[SessionResult, SessionResult]]:
    def serve(
        steps: list[Step],
        connector_a: dict[str, Any] | None,
        connector_b: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[SessionResult, SessionResult]:
        return serve_twice(tiny_model, steps, connector_a, connector_b, **kwargs)

    return serve
