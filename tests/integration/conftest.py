"""The vLLM fixtures (vllm_fixture.py), registered here once so that the session-scoped
ones (the tiny model, plain vLLM's reference outputs) are shared by every module."""

from vllm_fixture import reference, serve_a_then_b, tiny_model  # noqa: F401
