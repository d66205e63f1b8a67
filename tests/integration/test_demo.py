"""`kvmesh demo`, the README's main command, run as the installed console script
through a real vLLM on CPU (the tiny model, to keep it short)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

KVMESH = Path(sys.executable).parent / "kvmesh"


def demo(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVMESH), "demo", "--model", "tiny", "--tokens", "1000", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def hits(stdout: str) -> int:
    m = re.search(r"warm:\s+TTFT\s+[\d.]+ ms\s+(\d+) of 1000 tokens loaded from kvmesh", stdout)
    assert m, stdout
    return int(m.group(1))


def test_demo_serves_the_prompt_twice_and_the_second_loads_from_kvmesh() -> None:
    out = demo()
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert re.search(r"vLLM:\s+started in [\d.]+ s with the kvmesh connector", out.stdout)
    assert "768 tokens stored in kvmesh" in out.stdout
    assert hits(out.stdout) == 768  # three full 256-token chunks of 1000
    assert "same first token: yes" in out.stdout


def test_demo_starts_the_cache_server_its_config_names(tmp_path: Path) -> None:
    """--config names a kvmesh:// remote on loopback with nothing listening: the demo
    starts a cache-server, and a fresh vLLM process B loads what A stored there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text(
        "engine:\n"
        "  l1: {max_size: 128MiB, reserve: 0}\n"
        f"  remote: {{enabled: true, url: 'kvmesh://127.0.0.1:{port}', timeout_s: 5}}\n"
    )
    out = demo("--config", str(cfg), "--fresh-process")
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert re.search(rf"services: started a cache-server on 127\.0\.0\.1:{port} \(pid", out.stdout)
    assert "vLLM B:   a fresh process" in out.stdout
    assert hits(out.stdout) == 768
    # The demo stopped the cache-server it started.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_demo_without_a_lasting_tier_explains_why_a_fresh_process_misses() -> None:
    out = demo("--fresh-process")
    assert out.returncode == 1
    assert hits(out.stdout) == 0
    assert "name one in --config" in out.stderr
