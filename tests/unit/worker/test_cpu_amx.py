"""The AMX permission the vLLM connector asks for (services/worker/vllm/cpu_amx.py),
asked in a process of its own: the permission, once given, stays for the process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json
from kvmesh.services.worker.vllm.cpu_amx import amx_permitted, request_amx
before = amx_permitted()
granted = request_amx()
print(json.dumps([before, granted, amx_permitted(), request_amx()]))
"""


def cpu_has_amx() -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return any(line.startswith("flags") and " amx_tile" in line for line in text.splitlines())


def test_request_amx_grants_the_tile_state_where_the_cpu_has_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    before, granted, after, again = json.loads(out.stdout.strip().splitlines()[-1])
    # A fresh interpreter has not asked (nothing in it runs oneDNN's bfloat16 kernels).
    assert before is False
    # Granted exactly where the CPU (and kernel) have AMX; asking again is harmless.
    assert granted is after is again is cpu_has_amx()
