"""Helpers for the Helm chart's tests: the real `helm` and `kubernetes-validate`
binaries, rendering k8s/kvmesh with a value set, and looking objects up in the output.

    helm = helm_binary()                      # .tools/bin/helm or $KVMESH_HELM
    docs = render(helm, "pd")                 # the parsed objects of `helm template`
    sts = one(docs, "StatefulSet", "kvmesh-decoder")

A missing tool fails the test (scripts/install_deploy_tools.sh installs them): the
chart is checked for real or not at all.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.common.config import KvmeshConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "kvmesh"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CI_VALUES = ROOT / "k8s" / "ci"
RELEASE = "kvmesh"
NAMESPACE = "kvmesh-test"
KUBERNETES_VERSION = "1.30.0"
INSTALL_HINT = "run scripts/install_deploy_tools.sh (or scripts/setup.sh)"

# name -> extra `helm template` arguments; the CI value sets live in k8s/ci/.
VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    "redis-remote": ["-f", str(CI_VALUES / "redis-remote.yaml")],
    "pd": ["-f", str(CI_VALUES / "pd.yaml")],
    "podman": ["-f", str(CI_VALUES / "podman.yaml")],
    "secure": ["-f", str(CI_VALUES / "pd.yaml"), "-f", str(CI_VALUES / "secure.yaml")],
}


def helm_binary() -> str:
    """$KVMESH_HELM, else ./.tools/bin/helm; fails the test when neither runs."""
    helm = os.environ.get("KVMESH_HELM") or str(ROOT / ".tools" / "bin" / "helm")
    if not os.access(helm, os.X_OK):
        pytest.fail(f"helm not found at {helm}: {INSTALL_HINT}", pytrace=False)
    return helm


def kubernetes_validate_binary() -> str:
    """kubernetes-validate from this interpreter's environment, else from PATH."""
    beside = Path(sys.executable).parent / "kubernetes-validate"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("kubernetes-validate")
    if not found:
        pytest.fail(f"kubernetes-validate is not installed: {INSTALL_HINT}", pytrace=False)
    return found


def run(cmd: Sequence[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False
    )


def template_args(args: Sequence[str] = (), chart: Path = CHART) -> list[str]:
    return ["template", RELEASE, str(chart), "--namespace", NAMESPACE, *args]


def render_text(helm: str, args: Sequence[str] = (), chart: Path = CHART) -> str:
    """`helm template` output; fails the test, with helm's message, when it fails."""
    proc = run([helm, *template_args(args, chart)])
    if proc.returncode != 0:
        pytest.fail(f"helm template {' '.join(args)} failed:\n{proc.stderr}", pytrace=False)
    return proc.stdout


def parse(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(helm: str, value_set: str) -> list[dict[str, Any]]:
    return parse(render_text(helm, VALUE_SETS[value_set]))


def values_file(tmp_path: Path, values: Mapping[str, Any], name: str = "values.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(dict(values), sort_keys=False))
    return path


# --- looking things up in rendered objects ---------------------------------------------


def full_name(component: str) -> str:
    """The name the chart gives a component's objects under RELEASE."""
    return f"{RELEASE}-{component}"


def of_kind(docs: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def find(docs: Iterable[Mapping[str, Any]], kind: str, name: str) -> Mapping[str, Any] | None:
    return next((d for d in of_kind(docs, kind) if d["metadata"]["name"] == name), None)


def one(docs: Iterable[Mapping[str, Any]], kind: str, name: str) -> Mapping[str, Any]:
    docs = list(docs)
    found = find(docs, kind, name)
    if found is None:
        have = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        pytest.fail(f"no {kind}/{name} among {have}", pytrace=False)
    return found


def workloads(docs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def pod_spec(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    (only,) = pod_spec(workload)["containers"]
    return only


def env_of(c: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """name -> the env entry (with `value` or `valueFrom`)."""
    return {e["name"]: e for e in c.get("env", [])}


def port_number(c: Mapping[str, Any], port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    for p in c.get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    pytest.fail(f"container {c['name']} has no port named {port!r}", pytrace=False)


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def config_text(docs: Iterable[Mapping[str, Any]]) -> str:
    return one(docs, "ConfigMap", full_name("config"))["data"]["kvmesh.yaml"]


def config_dict(docs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(config_text(docs))


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of env values, command and args."""
    for name, val in env.items():
        value = value.replace(f"$({name})", val)
    return value


# --- what a container writes (read-only root filesystems) --------------------------------


def image_env(target: str) -> dict[str, str]:
    """docker/Dockerfile's ENV for a target ("services", "worker"): its base stage's,
    then its own."""
    stages: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        words = line.split()
        if line.startswith("FROM "):
            current = dict(stages.get(words[1], {}))
            stages[words[-1]] = current
        elif line.startswith("ENV "):
            for word in words[1:]:
                key, _, value = word.partition("=")
                current[key] = value
    return stages[target]


def written_paths(
    component: str, vllm: bool, cfg: KvmeshConfig, env: Mapping[str, str]
) -> dict[str, str]:
    """The directories a container's process writes at run time (path -> why): the
    component's kvmesh.yaml paths (cfg, with the container's KVMESH_* applied), and in a
    vLLM container what vLLM, torch and triton write given its environment (the image's
    and the container's own, env), as measured with `docker diff` on a running worker."""
    # Python's tempfile (any library); vLLM's torch.distributed file:// rendezvous.
    out = {"/tmp": "tempfile"}
    if component == "controller" and cfg.controller.snapshot_path:
        out[posixpath.dirname(cfg.controller.snapshot_path)] = "controller.snapshot_path"
    if component == "cacheserver" and cfg.cacheserver.spill_path:
        out[cfg.cacheserver.spill_path] = "cacheserver.spill_path"
    if vllm:
        if cfg.engine.disk.enabled:
            out[cfg.engine.disk.path] = "engine.disk.path"
        if cfg.engine.lookup_endpoint.startswith("ipc://"):
            out[posixpath.dirname(cfg.engine.lookup_endpoint[6:])] = "engine.lookup_endpoint"
        home = env["HOME"]
        for name, default in (
            ("VLLM_CACHE_ROOT", f"{home}/.cache/vllm"),
            ("VLLM_RPC_BASE_PATH", "/tmp"),
            ("XDG_CACHE_HOME", f"{home}/.cache"),  # torch, Hugging Face
            ("TRITON_CACHE_DIR", f"{home}/.triton/cache"),
            ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_kvmesh"),
        ):
            out[env.get(name, default)] = name
    return out
