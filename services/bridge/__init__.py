"""The bridge: an OpenAI-compatible HTTP proxy for disaggregated prefill (server.py)."""
