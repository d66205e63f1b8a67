"""MLA across two real processes: only rank 0 stores; rank 1 gets the KV by a gloo
broadcast, and both load exactly what rank 0 stored."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mla_rank0_stores_and_broadcasts(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtest.mla_rank",
                str(rank),
                str(port),
                str(tmp_path / f"{rank}.json"),
            ],
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
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["namespace"] == r1["namespace"]  # MLA keys do not depend on the rank
    assert (r0["stored"], r1["stored"]) == (40 // 8 * 8, 0)
    assert (r0["l1_chunks"], r1["l1_chunks"]) == (5, 0)
    assert r0["loaded"] == r1["loaded"] == 40
    assert r0["equal"] and r1["equal"]


def test_mla_layerwise_retrieve_broadcasts_too(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtest.mla_layerwise_rank",
                str(rank),
                str(port),
                str(tmp_path / f"{rank}.json"),
            ],
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
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert (r0["stored"], r1["stored"]) == (40, 0)
    assert r0["loaded"] == r1["loaded"] == 40  # rank 1 holds nothing: rank 0's broadcast
    assert r0["equal"] and r1["equal"]
    assert r0["steps"] == r1["steps"] == r0["layers"] - 1  # one step a layer, as ever
    assert r0["pinned"] == 0  # the load released its lookup's pins
