"""MLA across two real processes: only rank 0 stores; rank 1 gets the KV by a gloo
broadcast, and both load exactly what rank 0 stored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtest.service_process import free_port

TESTS = Path(__file__).resolve().parents[2]


def run_ranks(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    """Both ranks of kvtest.mla_rank in MODE; what each checked."""
    port = free_port()
    outs = [str(tmp_path / f"{rank}.json") for rank in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvtest.mla_rank", str(rank), str(port), outs[rank], mode],
            cwd=TESTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
    r0, r1 = (json.loads(Path(out).read_text()) for out in outs)
    return r0, r1


def test_mla_rank0_stores_and_broadcasts(tmp_path: Path) -> None:
    r0, r1 = run_ranks(tmp_path, "retrieve")
    assert r0["namespace"] == r1["namespace"]  # MLA keys do not depend on the rank
    assert (r0["stored"], r1["stored"]) == (40 // 8 * 8, 0)
    assert (r0["l1_chunks"], r1["l1_chunks"]) == (5, 0)
    assert r0["loaded"] == r1["loaded"] == 40
    assert r0["equal"] and r1["equal"]


def test_mla_layerwise_retrieve_broadcasts_too(tmp_path: Path) -> None:
    r0, r1 = run_ranks(tmp_path, "layerwise")
    assert (r0["stored"], r1["stored"]) == (40, 0)
    assert r0["loaded"] == r1["loaded"] == 40  # rank 1 holds nothing: rank 0's broadcast
    assert r0["equal"] and r1["equal"]
    assert r0["steps"] == r1["steps"] == r0["layers"] - 1  # one step a layer, as ever
    assert r0["pinned"] == 0  # the load released its lookup's pins
