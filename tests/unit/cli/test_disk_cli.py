"""`kvmesh disk scan`: what a start would keep and drop, and that it changes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from kvtest.disk import MiB, key_of, make_chunk

from kvmesh.common.chunk_codec import FILE_LAYOUT
from kvmesh.common.memory import HostMemoryPool
from kvmesh.services.cli.main import cli
from kvmesh.services.worker.tiers.disk import DiskTier
from kvmesh.services.worker.tiers.disk_format import chunk_file_name, temp_file_name

HEADER_SIZE = FILE_LAYOUT.size
SIZE = 64 * 1024
FILE = HEADER_SIZE + SIZE


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    """An engine.disk.path with one namespace directory of 5 chunks (oldest: 0), a
    leftover temporary file, a chunk file with a flipped header byte and a stray file."""
    root = tmp_path / "cache"
    d = root / key_of(0).namespace_id
    with HostMemoryPool(4 * MiB, SIZE, pin_memory=False) as pool:
        tier = DiskTier(d, 64 * MiB)
        for i in range(5):
            obj = make_chunk(pool, i, SIZE)
            tier.submit_put(key_of(i), obj)
            obj.ref_down()
            tier.flush(5)
            os.utime(d / chunk_file_name(key_of(i)), ns=(10**18 + i * 10**9,) * 2)
        tier.close()
    (d / temp_file_name(key_of(9), "deadbeef")).write_bytes(b"x" * 100)
    with open(d / chunk_file_name(key_of(4)), "r+b") as f:
        f.seek(50)
        f.write(b"\xee")
    (d / "notes.txt").write_text("mine")
    return root


def scan(*args: str):
    return CliRunner().invoke(cli, ["disk", "scan", "--no-progress", *args])


def test_scan_reports_keep_and_drop_and_changes_nothing(tier_dir: Path) -> None:
    d = tier_dir / key_of(0).namespace_id
    before = sorted(os.listdir(d))
    result = scan(str(tier_dir))
    assert result.exit_code == 0, result.output
    assert str(d) in result.output
    assert "keep           4 chunk files" in result.output
    assert "drop           2 files" in result.output
    assert "temporary file" in result.output and "bad header" in result.output
    assert "ignore         1 other files" in result.output
    assert sorted(os.listdir(d)) == before


def test_scan_json_with_max_size_matches_what_a_start_does(tier_dir: Path) -> None:
    d = tier_dir / key_of(0).namespace_id
    result = scan(str(d), "--max-size", str(2 * FILE), "--json")  # one tier's directory
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)["directories"]
    assert report["keep"] == {"files": 2, "bytes": 2 * FILE}
    evicted = sorted(x["file"] for x in report["drop"] if x["reason"].startswith("evicted"))
    assert evicted == sorted(chunk_file_name(key_of(i)) for i in (0, 1))
    assert report["ignored"] == ["notes.txt"]

    tier = DiskTier(d, 2 * FILE)  # a real start does the same
    try:
        assert tier.wait_indexed(10)
        tier.flush(5)
        kept = {f for f in os.listdir(d) if f.endswith(".kv")}
        assert kept == {chunk_file_name(key_of(i)) for i in (2, 3)}
    finally:
        tier.close()


def test_scan_verify_reads_payloads_and_shows_a_running_tier(tier_dir: Path) -> None:
    d = tier_dir / key_of(0).namespace_id
    with open(d / chunk_file_name(key_of(1)), "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        f.write(b"\x00\x01")
    assert "payload checksum" not in scan(str(d), "--list").output
    tier = DiskTier(d, 64 * MiB)
    try:
        out = scan(str(d), "--verify", "--list").output
        assert f"drop {chunk_file_name(key_of(1))}" in out and "payload checksum mismatch" in out
        assert f"in use by a running tier, pid {os.getpid()}" in out
    finally:
        tier.close()


def test_scan_rejects_a_bad_size(tier_dir: Path) -> None:
    result = scan(str(tier_dir), "--max-size", "lots")
    assert result.exit_code == 2
    assert "--max-size" in result.output


def test_scan_with_max_chunk_drops_a_file_claiming_more(tier_dir: Path) -> None:
    """A header over the engine's page (--max-chunk) is dropped, as the tier drops it."""
    d = tier_dir / key_of(0).namespace_id
    with HostMemoryPool(4 * MiB, 2 * SIZE, pin_memory=False) as big:
        tier = DiskTier(d, 64 * MiB)
        obj = make_chunk(big, 7, 2 * SIZE)
        tier.submit_put(key_of(7), obj)
        obj.ref_down()
        tier.flush(5)
        tier.close()
    big_file = chunk_file_name(key_of(7))
    assert "more than a chunk here" not in scan(str(d), "--list").output
    result = scan(str(d), "--max-chunk", str(SIZE), "--json")
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)["directories"]
    dropped = {x["file"]: x["reason"] for x in report["drop"]}
    assert dropped[big_file] == f"header says {2 * SIZE} bytes, more than a chunk here ({SIZE})"
    assert report["keep"] == {"files": 4, "bytes": 4 * FILE}
    assert big_file in os.listdir(d)  # a scan changes nothing
    assert scan(str(d), "--max-chunk", "0").exit_code == 2
