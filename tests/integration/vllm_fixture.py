"""Fixtures for end-to-end tests through a real vLLM on CPU (registered for every module
by tests/integration/conftest.py; import the helpers: `from vllm_fixture import Step`).

- `tiny_model`: the tiny random Llama and its tokenizer, built once and cached under
  $KVMESH_MODELS_DIR (default ~/.cache/kvmesh/models), so later runs start at once.
- `reference`: what plain vLLM (no connector) answers for each prompt of PROMPTS, cold
  and with a prefix cached by vLLM itself (see `Reference`): the outputs a run through
  kvmesh must reproduce exactly.
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
    "Reference",
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


class Reference:
    """Plain vLLM's answers (no connector), the outputs a run through kvmesh must equal
    exactly.

    vLLM on CPU is not invariant to how a prompt's prefill is split: a request whose
    first h tokens come from vLLM's own prefix cache answers ~1e-6 away from a cold
    one. So a kvmesh request that loaded h tokens is compared with plain vLLM that
    had the same h tokens cached by its own prefix cache (`split(name, h)`), and a
    request that computed everything with a cold run (`cold(name)`).
    """

    def __init__(self, cold: dict[str, StepResult], split: dict[tuple[str, int], StepResult]):
        self._cold, self._split = cold, split

    def cold(self, name: str) -> StepResult:
        return self._cold[name]

    def split(self, name: str, hit: int) -> StepResult:
        return self._split[(name, hit)]


# (prompt, tokens loaded) pairs the tests compare with.
SPLITS = [("p1000", 768), ("p1000", 512), ("p600", 512)]


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Reference:
    """One plain vLLM process with its prefix cache on; each case under its own cache
    salt, so cases do not share blocks. For split (name, h), a prompt with the same
    first h tokens and the same length is served first: its blocks hold exactly the
    KV a cold pass of the prompt computes for those tokens (one 1000-token pass each),
    which is what kvmesh stored."""
    steps = [Step(PROMPTS[n], cache_salt=f"cold-{n}") for n in PROMPTS]
    for n, h in SPLITS:
        prompt = PROMPTS[n]
        filler = prompt[:h] + prompt_tokens(len(prompt) - h, seed=99)
        steps += [Step(filler, cache_salt=f"{n}-{h}"), Step(prompt, cache_salt=f"{n}-{h}")]
    result = run_session(tiny_model, steps, llm_kwargs={"enable_prefix_caching": True})
    cold = dict(zip(PROMPTS, result.steps, strict=False))
    split = {}
    for i, case in enumerate(SPLITS):
        got = result.steps[len(PROMPTS) + 2 * i + 1]
        assert got.num_cached_tokens == case[1], (case, got.num_cached_tokens)
        split[case] = got
    assert all(r.num_cached_tokens == 0 for r in cold.values())
    return Reference(cold, split)


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
