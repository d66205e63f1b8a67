"""`kvmesh demo --engine-only` and `kvmesh --version`, run as the installed console
script (the vLLM demo: tests/integration/test_demo.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvmesh import __version__

KVMESH = Path(sys.executable).parent / "kvmesh"


def test_version_is_the_package_version() -> None:
    out = subprocess.run([str(KVMESH), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert __version__ in out.stdout


def test_demo_stores_and_loads_back_bitwise() -> None:
    out = subprocess.run(
        [str(KVMESH), "demo", "--engine-only", "--tokens", "1100", "--layers", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # 1100 tokens hold four full 256-token chunks; the tail of 76 is not stored.
    assert re.search(r"store:\s+1024 of 1100 tokens \(4 full chunks\)", out.stdout)
    assert re.search(r"lookup:\s+1024 tokens cached", out.stdout)
    assert re.search(r"retrieve: 1024 tokens", out.stdout)
    assert "bitwise equal over 3 layers" in out.stdout
