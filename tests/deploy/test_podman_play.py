"""The Helm chart's Deployments run for real, without a cluster: `helm template` with
k8s/ci/podman.yaml, played with `podman kube play` (Debian bookworm's podman 4.3), until
the controller, the lookup-server, the cache-server, the vLLM worker and the bridge in
front of it all answer their readiness probes' endpoints; then a completion through
the bridge, and `podman kube down`.

What podman 4.3 on this machine needs, found by trying:

- Only Deployment, PersistentVolumeClaim and ConfigMap objects are played (podman skips
  StatefulSets, Services and PodDisruptionBudgets): podman.yaml makes the cache-server
  and the worker Deployments (`kind: Deployment`).
- No bridge networking or iptables here: every pod on the host network (the chart's
  `hostNetwork`), with podman.yaml's ports (the defaults plus 10000) so that a compose
  mesh on the same host does not collide.
- podman 4.3 publishes every containerPort, which a host-network pod refuses
  ("PortMappings can only be used with Bridge or slirp4netns networking"): the played
  copy drops the containers' `ports` (the probes and Services are what use them, and
  podman runs neither).
- The Services' names come from the chart's `hostAliases`, but podman 4.3 writes them
  only into a host-network pod's infra container's /etc/hosts, not the others': the
  same entries go into a `base_hosts_file` in the containers.conf this test writes.
- That containers.conf (CONTAINERS_CONF) also keeps ulimits at 1024 (nofile and
  nproc): podman's defaults are more than this sandbox lets runc set.
- status.podIP and $(VAR) references are beyond podman 4.3: the chart's `podIP`.
- Storage: podman's default, overlay under /var/lib/containers/storage (native
  overlay diff on ext4 works here; vfs is not needed). Images move from the private
  Docker daemon (docker/dockerd.sh) with `docker save | podman load`, skipped when
  podman already has the same image id.
- The pods' pause image is built by podman from `catatonit` (apt-get install
  catatonit).
- Probes become podman health checks, which need systemd to run: they never run here,
  so this test polls the probes' endpoints itself.

Runtime: ~1 min to load both images the first time (the worker's is 4.6 GB), ~1-2 min
for vLLM to start on 2 cores. A missing podman, helm, Docker daemon or catatonit fails
the test; missing images are built with docker/build.sh (rebuild after changing the
source: this test does not).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helm import (
    CI_VALUES,
    ROOT,
    container,
    helm_binary,
    parse,
    pod_spec,
    port_number,
    render_text,
)
from kvtest.waiting import wait_for

from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

pytestmark = pytest.mark.timeout(1800)

VALUES = ["-f", str(CI_VALUES / "podman.yaml")]
PLAYABLE = {"Deployment", "PersistentVolumeClaim", "ConfigMap"}
COMPONENTS = {"controller", "lookup", "cacheserver", "bridge", "worker"}
HEALTH_TIMEOUT_S = 420.0


def _run(
    cmd: list[str], env: Mapping[str, str] | None = None, timeout_s: float = 120, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False, **kw
    )


def _must(proc: subprocess.CompletedProcess[str], what: str) -> str:
    if proc.returncode != 0:
        pytest.fail(
            f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    return proc.stdout


# --- the objects -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return parse(render_text(helm_binary(), VALUES))


def component(doc: Mapping[str, Any]) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def playable(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects podman 4.3 plays, with the containers' ports dropped (see above)."""
    out = []
    for doc in docs:
        if doc["kind"] not in PLAYABLE:
            continue
        doc = json.loads(json.dumps(doc))
        if doc["kind"] == "Deployment":
            for c in pod_spec(doc)["containers"]:
                c.pop("ports", None)
        out.append(doc)
    return out


def health_urls(docs: list[dict[str, Any]]) -> dict[str, str]:
    """component -> the URL of its readiness probe, on the host network."""
    urls = {}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        c = container(d)
        probe = c["readinessProbe"]["httpGet"]
        urls[component(d)] = f"http://127.0.0.1:{port_number(c, probe['port'])}{probe['path']}"
    return urls


def test_podman_value_set_is_all_playable(rendered: list[dict[str, Any]]) -> None:
    """Every workload is a Deployment on the host network, every component is there,
    and the Services' names map to 127.0.0.1 in every pod."""
    deployments = [d for d in rendered if d["kind"] == "Deployment"]
    assert {component(d) for d in deployments} == COMPONENTS
    assert not [d for d in rendered if d["kind"] in ("StatefulSet", "DaemonSet", "Job")]
    services = {d["metadata"]["name"] for d in rendered if d["kind"] == "Service"}
    for d in deployments:
        spec = pod_spec(d)
        assert spec["hostNetwork"] is True
        aliased = {h for a in spec["hostAliases"] if a["ip"] == "127.0.0.1" for h in a["hostnames"]}
        assert services <= aliased, services - aliased
        env = {e["name"]: e for e in container(d)["env"]}
        assert env["POD_IP"] == {"name": "POD_IP", "value": "127.0.0.1"}
        # Nothing left for podman 4.3 to expand but the connector's instance_id.
        for e in container(d)["env"]:
            assert "$(" not in str(e.get("value", "")), e


# --- podman -------------------------------------------------------------------------------


def _podman_env(tmp: Path, docs: list[dict[str, Any]]) -> dict[str, str]:
    """CONTAINERS_CONF: ulimits this sandbox allows; /etc/hosts from the hostAliases."""
    hosts = ["127.0.0.1\tlocalhost"]
    seen: set[tuple[str, str]] = set()
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for alias in pod_spec(d).get("hostAliases", []):
            for name in alias["hostnames"]:
                if (alias["ip"], name) not in seen:
                    seen.add((alias["ip"], name))
                    hosts.append(f"{alias['ip']}\t{name}")
    (tmp / "hosts").write_text("\n".join(hosts) + "\n")
    (tmp / "containers.conf").write_text(
        "[containers]\n"
        'default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
        f'base_hosts_file = "{tmp / "hosts"}"\n'
    )
    env = dict(os.environ)
    env["CONTAINERS_CONF"] = str(tmp / "containers.conf")
    return env


def _docker_env() -> dict[str, str]:
    assert shutil.which("docker") and shutil.which("dockerd"), "docker missing: scripts/setup.sh"
    env = dict(os.environ)
    if not env.get("DOCKER_HOST"):
        proc = _run([str(ROOT / "docker" / "dockerd.sh")], env)
        env["DOCKER_HOST"] = _must(proc, "docker/dockerd.sh").strip()
    return env


def _image_id(tool: list[str], image: str, env: Mapping[str, str]) -> str | None:
    proc = _run([*tool, "image", "inspect", "--format", "{{.Id}}", image], env)
    if proc.returncode != 0:
        return None
    return proc.stdout.strip().removeprefix("sha256:")


def _load_images(images: set[str], podman_env: dict[str, str]) -> None:
    """Each image from the private Docker daemon into podman's storage, unless podman
    has that image id already; builds with docker/build.sh what Docker lacks."""
    docker_env = _docker_env()
    if any(_image_id(["docker"], i, docker_env) is None for i in images):
        _must(_run([str(ROOT / "docker" / "build.sh")], docker_env, 1800), "docker/build.sh")
    for image in sorted(images):
        want = _image_id(["docker"], image, docker_env)
        assert want, f"docker/build.sh made no {image}"
        have = _image_id(["podman"], f"localhost/{image}", podman_env)
        if have == want:
            continue
        save = subprocess.Popen(["docker", "save", image], env=docker_env, stdout=subprocess.PIPE)
        load = _run(["podman", "load", "-q"], podman_env, 900, stdin=save.stdout)
        assert save.stdout is not None
        save.stdout.close()
        assert save.wait(timeout=60) == 0, f"docker save {image} failed"
        _must(load, f"docker save {image} | podman load")
        assert _image_id(["podman"], f"localhost/{image}", podman_env) == want
        if have:  # the previous build, now untagged
            _run(["podman", "rmi", have], podman_env)


def _cleanup(manifest: Path, docs: list[dict[str, Any]], env: Mapping[str, str]) -> None:
    """`podman kube down`, then whatever it leaves: pods, PVC and ConfigMap volumes."""
    _run(["podman", "kube", "down", str(manifest)], env, 180)
    for d in docs:
        name = d["metadata"]["name"]
        if d["kind"] == "Deployment":
            for i in range(d["spec"].get("replicas", 1)):
                _run(["podman", "pod", "rm", "-f", f"{name}-pod-{i}"], env, 120)
        else:  # PersistentVolumeClaim, ConfigMap: volumes of the same name
            _run(["podman", "volume", "rm", "-f", name], env)


def _get(url: str, timeout_s: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, TimeoutError) as e:
        return 0, repr(e)


def _diagnostics(docs: list[dict[str, Any]], env: Mapping[str, str]) -> str:
    out = [_run(["podman", "ps", "-a"], env).stdout]
    for d in docs:
        if d["kind"] == "Deployment":
            name = f"{d['metadata']['name']}-pod-0-{container(d)['name']}"
            proc = _run(["podman", "logs", "--tail", "25", name], env)
            out.append(f"--- {name}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return "\n".join(out)


@pytest.fixture(scope="module")
def played(
    rendered: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    if not shutil.which("podman"):
        pytest.fail("podman is not installed: scripts/setup.sh (apt-get install podman runc)")
    tmp = tmp_path_factory.mktemp("podman")
    docs = playable(rendered)
    manifest = tmp / "kvmesh.yaml"
    manifest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    env = _podman_env(tmp, docs)
    images = {c["image"] for d in docs if d["kind"] == "Deployment" for c in [container(d)]}
    t0 = time.monotonic()
    _load_images(images, env)
    loaded_s = time.monotonic() - t0
    _cleanup(manifest, docs, env)  # what a killed run left behind
    try:
        proc = _run(["podman", "kube", "play", str(manifest)], env, 300)
        if proc.returncode != 0 and "catatonit" in proc.stderr:
            pytest.fail(f"apt-get install catatonit (podman's pause image):\n{proc.stderr}")
        _must(proc, "podman kube play")
        yield {"docs": docs, "rendered": rendered, "env": env, "loaded_s": loaded_s}
    finally:
        _cleanup(manifest, docs, env)
        left = _run(
            ["podman", "pod", "ls", "-q", "--filter", "label=app.kubernetes.io/part-of=kvmesh"], env
        )
        assert not left.stdout.strip(), f"pods left after kube down: {left.stdout}"


def test_every_component_healthy(played: dict[str, Any]) -> None:
    docs, env = played["docs"], played["env"]
    urls = health_urls(played["rendered"])
    assert set(urls) == COMPONENTS
    last: dict[str, tuple[int, str]] = {}
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        last = {name: _get(url) for name, url in urls.items()}
        if all(status == 200 for status, _ in last.values()):
            break
        time.sleep(2)
    unhealthy = {n: f"{urls[n]} -> {s} {b[:300]}" for n, (s, b) in last.items() if s != 200}
    assert not unhealthy, (
        f"not healthy within {HEALTH_TIMEOUT_S:.0f}s: {json.dumps(unhealthy, indent=1)}\n"
        + _diagnostics(docs, env)
    )
    # Each kvmesh service says so in its body, not only with its status.
    for name in ("controller", "lookup", "cacheserver"):
        assert json.loads(last[name][1])["status"] == "ok", last[name]
    # The worker's connector registered with the controller (found by its Service's name).
    workers = wait_for(
        lambda: json.loads(_get(urls["controller"])[1]).get("workers"),
        timeout=60,
        what="the worker registered with the controller",
    )
    assert workers == 1
    # The pods' names resolve as their Services' would, and no container restarted.
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        name = f"{d['metadata']['name']}-pod-0-{container(d)['name']}"
        proc = _run(["podman", "inspect", "--format", "{{.RestartCount}}", name], env)
        assert _must(proc, f"podman inspect {name}").strip() == "0", _diagnostics(docs, env)


def test_completion_through_the_bridge(played: dict[str, Any]) -> None:
    """The bridge reaches the worker by its Service's name and returns its tokens."""
    test_every_component_healthy(played)
    bridge = health_urls(played["rendered"])["bridge"].rsplit("/", 1)[0]
    body = {"model": "tiny", "prompt": prompt_tokens(64), "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        bridge + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
    assert answer["usage"]["completion_tokens"] >= 1, answer


def test_pods_run_as_the_image_user_without_capabilities(played: dict[str, Any]) -> None:
    """The chart's security contexts reach the containers podman runs: uid/gid 10001
    (not root), no capabilities, no-new-privileges, seccomp filtering, a read-only root
    filesystem (a write to / fails with EROFS, not EACCES); and each volume the chart
    mounts for writing (snapshot, spill, disk tier, /tmp, the vLLM HOME) is writable,
    with every component up (test_every_component_healthy)."""
    test_every_component_healthy(played)
    docs, env = played["docs"], played["env"]
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        c = container(d)
        pod_sc, sc = pod_spec(d)["securityContext"], c["securityContext"]
        uid, gid = pod_sc["runAsUser"], pod_sc["runAsGroup"]
        assert uid != 0 and pod_sc["runAsNonRoot"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
        name = f"{d['metadata']['name']}-pod-0-{c['name']}"
        (info,) = json.loads(_must(_run(["podman", "inspect", name], env), f"inspect {name}"))
        assert info["Config"]["User"] == f"{uid}:{gid}", name
        assert not info["EffectiveCaps"] and not info["BoundingCaps"], name
        assert "no-new-privileges" in info["HostConfig"]["SecurityOpt"], name
        assert sc["readOnlyRootFilesystem"] is True
        assert info["HostConfig"]["ReadonlyRootfs"] is True, name
        writable = [m["mountPath"] for m in c["volumeMounts"]
                    if m["name"] in ("snapshot", "spill", "disk", "tmp", "home")]  # fmt: skip
        assert "/tmp" in writable, name
        script = (
            'grep -E "^(Uid|Gid|CapEff|NoNewPrivs|Seccomp):" /proc/1/status | tr -s "\\t" " "; '
            'touch /.kvmesh-probe 2>&1 | grep -q "Read-only file" && echo "read-only /"; '
            'for p in "$@"; do test -w "$p" && echo "writable $p"; done'
        )
        out = _must(_run(["podman", "exec", name, "sh", "-c", script, "sh", *writable], env),
                    f"exec {name}").splitlines()  # fmt: skip
        assert out[:6] == [
            f"Uid: {uid} {uid} {uid} {uid}",
            f"Gid: {gid} {gid} {gid} {gid}",
            "CapEff: 0000000000000000",
            "NoNewPrivs: 1",
            "Seccomp: 2",
            "read-only /",
        ], (name, out)
        assert out[6:] == [f"writable {p}" for p in writable], (name, out)
