"""docker/build.sh's own failure reporting, without a Docker daemon: the project's
wheel is its first step, and a wheel that does not build must say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "error: setup.py says no (test marker)"


def test_build_sh_shows_why_the_wheel_failed(tmp_path: Path) -> None:
    # A venv whose python is the real one, except that `pip wheel` fails as a broken
    # source would: pip's error on stderr, exit status 1.
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"pip wheel"*)\n'
        f'  echo "Processing /src"; echo "{MARKER}" >&2; exit 1;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    ctx = tmp_path / "ctx"
    env = {
        **os.environ,
        "KVMESH_VENV": str(venv.parent),
        "KVMESH_DOCKER_CONTEXT": str(ctx),
        # Never reached: the wheel fails before any Docker or debootstrap step.
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",
        "KVMESH_DOCKER_ROOT": str(tmp_path / "docker-root"),
    }
    proc = subprocess.run(
        [str(ROOT / "docker" / "build.sh"), "services"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert MARKER in proc.stderr, proc.stderr
    assert "did not build" in proc.stderr and str(ctx / "wheel.log") in proc.stderr
    assert MARKER in (ctx / "wheel.log").read_text()
    # It stopped there: no base image, no vendored wheels.
    assert not (tmp_path / "docker-root").exists()
    assert not (ctx / "wheels").exists()
