"""`kvmesh config check`, run as the installed console script in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

# The console script sits next to the interpreter running the tests (the venv's bin/).
KVMESH = Path(sys.executable).parent / "kvmesh"


def run_kvmesh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    assert KVMESH.exists(), f"console script not installed at {KVMESH}"
    # Start from an environment without KVMESH_* so the developer's shell cannot leak in.
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVMESH_")}
    clean.update(env or {})
    return subprocess.run(
        [str(KVMESH), *args], capture_output=True, text=True, env=clean, timeout=60
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvmesh.yaml"
    path.write_text(text)
    return path


def test_misspelt_key_fails_naming_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  l1:\n    max_sise: 1GiB\n")
    result = run_kvmesh("config", "check", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert "engine.l1.max_sise" in result.stderr
    assert str(path) in result.stderr
    assert "did you mean engine.l1.max_size" in result.stderr


def test_valid_file_prints_effective_values(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  chunk_size: 512\n  l1:\n    max_size: 1073741824\n")
    result = run_kvmesh("config", "check", str(path))
    assert result.returncode == 0, result.stderr
    values = yaml.safe_load(result.stdout)
    assert values["engine"]["chunk_size"] == 512
    assert values["engine"]["l1"]["max_size"] == "1GiB"
    assert values["cacheserver"]["max_memory"] == "4GiB"  # defaults are printed too
    assert values["logging"] == {"level": "info", "json": True}


def test_json_output_and_env_switch(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  chunk_size: 512\n")
    env = {"KVMESH_ENGINE__CHUNK_SIZE": "1024"}

    with_env = run_kvmesh("config", "check", "--json", str(path), env=env)
    assert with_env.returncode == 0, with_env.stderr
    assert json.loads(with_env.stdout)["engine"]["chunk_size"] == 1024

    without_env = run_kvmesh("config", "check", "--json", "--no-env", str(path), env=env)
    assert without_env.returncode == 0, without_env.stderr
    assert json.loads(without_env.stdout)["engine"]["chunk_size"] == 512


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    result = run_kvmesh("config", "check", str(path), env={"KVMESH_BRIDGE__PORT": "70000"})
    assert result.returncode == 2
    assert "bridge.port" in result.stderr
    assert "KVMESH_BRIDGE__PORT" in result.stderr


def test_yaml_syntax_error_and_missing_file(tmp_path: Path) -> None:
    path = write(tmp_path, "engine: [\n")
    broken = run_kvmesh("config", "check", str(path))
    assert broken.returncode == 2
    assert str(path) in broken.stderr
    assert "YAML syntax error" in broken.stderr

    missing = run_kvmesh("config", "check", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2
    assert "absent.yaml" in missing.stderr


def test_module_entry_point_runs_too(tmp_path: Path) -> None:
    path = write(tmp_path, "controller:\n  port: 7601\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli.main", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["controller"]["port"] == 7601
