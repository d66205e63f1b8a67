"""`kvmesh disk scan` on a messy directory (H15 audit): an unreadable namespace
directory, misplaced chunk files, a directory and a symlink under temporary names.
Run as a real process without the permission override root has, so unreadable means
unreadable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvtest.disk import MiB, key_of, make_chunk

from kvmesh.common.memory import HostMemoryPool
from kvmesh.services.worker.tiers.disk import DiskTier
from kvmesh.services.worker.tiers.disk_format import chunk_file_name

SIZE = 64 * 1024
NS_A = "0123456789abcdef"  # unreadable
NS_B = "fedcba9876543210"


def _scan(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "from kvmesh.services.cli.main import cli; cli()"]
    if os.geteuid() == 0:
        # Root reads any file; without these capabilities it obeys the modes.
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    return subprocess.run(
        [*cmd, "disk", "scan", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def messy(tmp_path: Path):
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root's permission override")
    root = tmp_path / "cache"
    b = root / NS_B
    with HostMemoryPool(4 * MiB, SIZE, pin_memory=False) as pool:
        tier = DiskTier(b, 64 * MiB, io_threads=1)
        assert tier.wait_indexed(10)
        for i in range(3):
            obj = make_chunk(pool, i, SIZE)
            tier.submit_put(key_of(i), obj)
            obj.ref_down()
        assert tier.flush(10)
        tier.close()
    # Two chunk files copied under other keys' names: one reason, one line.
    for src, dst in ((0, 7), (1, 8)):
        shutil.copy(b / chunk_file_name(key_of(src)), b / chunk_file_name(key_of(dst)))
    (b / f".{key_of(9).to_str()}.1.run.tmp").mkdir()  # a directory, not a write
    big = tmp_path / "big"
    big.write_bytes(b"\0" * (1 << 20))
    os.symlink(big, b / ".stray.tmp")  # unlinking removes the link, not 1 MiB
    (b / ".a\nb.tmp").write_bytes(b"x")  # a name that would split a line of the list
    a = root / NS_A
    a.mkdir()
    shutil.copy(b / chunk_file_name(key_of(0)), a)
    a.chmod(0)
    yield root
    a.chmod(0o755)


def test_scan_reports_an_unreadable_directory_and_goes_on(messy: Path) -> None:
    result = _scan(str(messy))
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"{messy / NS_A}: cannot read: Permission denied" in result.stderr
    out = result.stdout
    assert f"{messy / NS_B}\n" in out  # the readable tier is still reported
    assert "keep           3 chunk files" in out
    assert "2  holds another key (a misplaced or renamed file)" in out
    # The link counts as itself; the directory is left alone, as a start does.
    assert "drop           4 files" in out
    assert "ignore         1 other files" in out

    listed = _scan(str(messy / NS_B), "--list")
    assert listed.returncode == 0, listed.stderr
    stray = [line for line in listed.stdout.splitlines() if "drop .stray.tmp" in line]
    assert len(stray) == 1 and "MiB" not in stray[0], listed.stdout  # the link's own size
    assert "  drop '.a\\nb.tmp'  1 B" in listed.stdout, listed.stdout
    assert f"drop .{key_of(9).to_str()}" not in listed.stdout


def test_scan_json_names_the_unreadable_directory(messy: Path) -> None:
    result = _scan(str(messy), "--json")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    dirs = {d["path"]: d for d in json.loads(result.stdout)["directories"]}
    assert dirs[str(messy / NS_A)]["error"] == "cannot read: Permission denied"
    assert dirs[str(messy / NS_B)]["error"] is None
    assert dirs[str(messy / NS_B)]["keep"]["files"] == 3
