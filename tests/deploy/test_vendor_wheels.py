"""docker/vendor_wheels.py, which docker/build.sh runs with --quiet: when pip cannot
fetch a wheel (no registry, a version the registry lacks) the build stops with pip's
own reason on stderr and a line naming the requirements file, not a bare traceback
of the subprocess call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_fetch_says_why(tmp_path: Path) -> None:
    out = tmp_path / "wheels"
    # No index and no local wheels: pip can fetch nothing (and nothing is downloaded).
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "vendor_wheels.py"), "--quiet", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "No matching distribution found for" in proc.stderr, proc.stderr
    assert f"pip could not fetch the wheels listed in {out / 'requirements.txt'}" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # The pins it made are there for a retry.
    assert "msgspec==" in (out / "requirements.txt").read_text()
