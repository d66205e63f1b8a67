"""The Helm chart k8s/kvmesh, checked with the real tools and without a cluster:

- `helm lint --strict` and `helm template` with the default values and the CI value
  sets in k8s/ci/ (redis-remote: an external Redis and ServiceMonitors; pd: prefillers,
  decoders and the bridge; podman: Deployments only, on the host network, which
  test_podman_play.py plays);
- `kubernetes-validate --strict` against Kubernetes 1.30 on each rendering;
- the rendered objects: probes on the ports the config makes each process serve,
  Services and the PodDisruptionBudget selecting the right pods, volumes where the
  config puts the snapshot, spill and disk tier, the ConfigMap's kvmesh.yaml passing
  kvmesh's own validation (with each pod's KVMESH_* variables applied), env, resources;
- read-only root filesystems, with every directory a process writes on a volume;
- values.schema.json rejecting wrong types and unknown keys, naming them.

helm and kubernetes-validate come from scripts/install_deploy_tools.sh; without them
these tests fail rather than skip.
"""

from __future__ import annotations

import json
import posixpath
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helm import (
    CHART,
    KUBERNETES_VERSION,
    NAMESPACE,
    ROOT,
    VALUE_SETS,
    config_dict,
    config_text,
    container,
    env_of,
    expand,
    full_name,
    helm_binary,
    image_env,
    kubernetes_validate_binary,
    matches,
    of_kind,
    one,
    parse,
    pod_spec,
    port_number,
    render,
    render_text,
    run,
    template_args,
    values_file,
    workloads,
    written_paths,
)

from kvmesh.common.config import ConfigError, load_config

CONFIG_PATH = "/etc/kvmesh/kvmesh.yaml"
DASHBOARD_FILE = CHART / "dashboards" / "kvmesh.json"
POD_IP = "10.1.2.3"
SETS = list(VALUE_SETS)
# podman.yaml moves every port up by 10000 (a compose mesh may hold the defaults).
PORT_OFFSET = {"podman": 10000}


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


@pytest.fixture(scope="module")
def rendered(helm: str) -> dict[str, list[dict[str, Any]]]:
    return {name: render(helm, name) for name in SETS}


# --- the tools ----------------------------------------------------------------------


@pytest.mark.parametrize("value_set", SETS)
def test_helm_lint_strict(helm: str, value_set: str) -> None:
    proc = run([helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                *VALUE_SETS[value_set]])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("value_set", SETS)
def test_kubernetes_validate_strict(helm: str, value_set: str, tmp_path: Path) -> None:
    manifest = tmp_path / f"{value_set}.yaml"
    manifest.write_text(render_text(helm, VALUE_SETS[value_set]))
    docs = parse(manifest.read_text())
    proc = run([kubernetes_validate_binary(), "--strict", "-k", KUBERNETES_VERSION, str(manifest)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "ERROR" not in out and "FAIL" not in out, out
    # Every object of a built-in kind was checked (kubernetes-validate only warns about
    # kinds it has no schema for: the ServiceMonitor CRD).
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue
        line = f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']} "
        assert line in out, f"{line!r} not in:\n{out}"
    unchecked = {line.split(" for kind ")[1].split()[0] for line in out.splitlines()
                 if "Couldn't find schema" in line}  # fmt: skip
    assert unchecked <= {"ServiceMonitor"}, out


# --- what each value set renders -------------------------------------------------------

EXPECTED = {
    "default": {
        ("Deployment", "controller"), ("Deployment", "lookup"), ("StatefulSet", "cacheserver"),
        ("StatefulSet", "worker"), ("PodDisruptionBudget", "cacheserver"),
        ("PersistentVolumeClaim", "controller"), ("ConfigMap", "config"),
        ("Service", "controller"), ("Service", "lookup"), ("Service", "cacheserver"),
        ("Service", "cacheserver-headless"), ("Service", "worker"),
        ("Service", "worker-headless"),
    },
    "redis-remote": {
        ("Deployment", "controller"), ("Deployment", "lookup"), ("StatefulSet", "worker"),
        ("PersistentVolumeClaim", "controller"), ("ConfigMap", "config"),
        ("Service", "controller"), ("Service", "lookup"), ("Service", "worker"),
        ("Service", "worker-headless"), ("ServiceMonitor", "controller"),
        ("ServiceMonitor", "lookup"), ("ServiceMonitor", "worker"),
    },
    "podman": {
        ("Deployment", "controller"), ("Deployment", "lookup"), ("Deployment", "cacheserver"),
        ("Deployment", "worker"), ("Deployment", "bridge"), ("PodDisruptionBudget", "cacheserver"),
        ("PersistentVolumeClaim", "controller"), ("ConfigMap", "config"),
        ("Service", "controller"), ("Service", "lookup"), ("Service", "cacheserver"),
        ("Service", "worker"), ("Service", "bridge"),
    },
    "pd": {
        ("Deployment", "controller"), ("Deployment", "lookup"), ("Deployment", "bridge"),
        ("StatefulSet", "cacheserver"), ("StatefulSet", "prefiller"),
        ("StatefulSet", "decoder"), ("PodDisruptionBudget", "cacheserver"),
        ("ConfigMap", "config"), ("Service", "controller"), ("Service", "lookup"),
        ("Service", "cacheserver"), ("Service", "cacheserver-headless"), ("Service", "bridge"),
        ("Service", "prefiller-headless"), ("Service", "decoder-headless"),
    },
}  # fmt: skip
# secure.yaml adds Secrets' mounts (no object) and the dashboard's ConfigMap to pd.yaml.
EXPECTED["secure"] = EXPECTED["pd"] | {("ConfigMap", "dashboard")}


@pytest.mark.parametrize("value_set", SETS)
def test_objects(rendered: dict, value_set: str) -> None:
    got = {(d["kind"], d["metadata"]["name"]) for d in rendered[value_set]}
    want = {(kind, full_name(component)) for kind, component in EXPECTED[value_set]}
    assert got == want
    for doc in rendered[value_set]:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "kvmesh"
        assert labels["app.kubernetes.io/name"] == "kvmesh"


# --- kvmesh.yaml ------------------------------------------------------------------------


def _load(tmp_path: Path, docs: list, env: dict[str, str] | None = None):
    path = tmp_path / "kvmesh.yaml"
    path.write_text(config_text(docs))
    return load_config(path, env=env or {})


def _pod_env(c: dict, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet would make it, with POD_IP and
    secret values filled in; expanded $(VAR) references."""
    out: dict[str, str] = {}
    for name, entry in env_of(c).items():
        if "value" in entry:
            out[name] = expand(str(entry["value"]), out)
        else:
            source = entry["valueFrom"]
            if "fieldRef" in source:
                field = source["fieldRef"]["fieldPath"]
                out[name] = {"status.podIP": POD_IP, "metadata.name": "pod-0"}[field]
            else:
                key = source["secretKeyRef"]["key"]
                out[name] = (secrets or {})[key]
    return out


@pytest.mark.parametrize("value_set", SETS)
def test_config_passes_kvmesh_validation(rendered: dict, value_set: str, tmp_path: Path) -> None:
    docs = rendered[value_set]
    cfg = _load(tmp_path, docs)
    off = PORT_OFFSET.get(value_set, 0)
    # Services bind every interface in a pod; ports are the ones the chart exposes.
    assert cfg.controller.host == cfg.lookup.host == cfg.cacheserver.host == "0.0.0.0"
    assert cfg.bridge.host == "0.0.0.0"
    assert (cfg.controller.port, cfg.controller.http_port) == (7600 + off, 7601 + off)
    # The KV-event feed and its replay socket, on by default (as in compose).
    assert (cfg.controller.events_port, cfg.controller.events_replay_port) == (
        7602 + off,
        7603 + off,
    )
    assert (cfg.lookup.port, cfg.lookup.metrics_port) == (7610 + off, 7611 + off)
    assert (cfg.cacheserver.port, cfg.cacheserver.metrics_port) == (7620 + off, 7622 + off)
    assert cfg.cacheserver.data_port == 7623 + off  # a fixed port a Service can forward
    assert (cfg.bridge.port, cfg.bridge.metrics_port) == (7630 + off, 7631 + off)
    assert cfg.engine.metrics_port == 7640 + off and cfg.engine.p2p.port == 7650 + off
    controller = f"tcp://{full_name('controller')}:{7600 + off}"
    assert cfg.lookup.controller_url == controller
    assert cfg.engine.controller.enabled and cfg.engine.controller.url == controller
    # The lookup-server hashes prompts as the engines do.
    assert cfg.lookup.chunk_size == cfg.engine.chunk_size
    assert cfg.lookup.hash_algorithm == cfg.engine.hash_algorithm
    # Each vLLM pod's own KVMESH_* variables on top of the file still validate.
    for w in workloads(docs):
        c = container(w)
        if c["name"] != "vllm":
            continue
        env = _pod_env(c, secrets={"redis-password": "s3cret"})
        pod_cfg = _load(tmp_path, docs, env=env)
        pod_ip = "127.0.0.1" if value_set == "podman" else POD_IP  # podman.yaml's podIP
        assert env["POD_IP"] == pod_ip
        assert pod_cfg.engine.p2p.host == pod_ip
        assert pod_cfg.engine.lookup_endpoint == f"tcp://{pod_ip}:{7660 + off}"


def test_default_config(rendered: dict, tmp_path: Path) -> None:
    cfg = _load(tmp_path, rendered["default"])
    assert cfg.engine.remote.enabled
    assert cfg.engine.remote.url == f"kvmesh://{full_name('cacheserver')}:7620"
    assert cfg.engine.disk.enabled and cfg.engine.disk.path == "/var/cache/kvmesh"
    assert cfg.cacheserver.spill_path == "/var/cache/kvmesh-cacheserver"
    assert cfg.controller.snapshot_path == "/var/lib/kvmesh/controller.snapshot"
    assert not cfg.cacheserver.lm_enabled
    assert cfg.bridge.prefillers == [] and cfg.bridge.decoders == []


def test_user_config_reaches_kvmesh_yaml(rendered: dict, tmp_path: Path) -> None:
    cfg = _load(tmp_path, rendered["redis-remote"])
    assert cfg.engine.chunk_size == 128 and cfg.lookup.chunk_size == 128
    assert cfg.engine.hash_algorithm == "blake3" == cfg.lookup.hash_algorithm
    assert cfg.engine.remote.compression == "lz4"
    assert cfg.engine.remote.key_prefix == "kvmesh-ci:"
    assert cfg.logging.level == "debug"
    assert config_dict(rendered["redis-remote"])["engine"]["l1"]["max_size"] == "1GiB"


# --- probes, ports, Services --------------------------------------------------------------

# component -> (liveness, readiness) as (kind, path, port number); the port numbers are
# where kvmesh.yaml (checked above) makes each process serve.
PROBES = {
    "controller": (("httpGet", "/health", 7601), ("httpGet", "/health", 7601)),
    "lookup": (("httpGet", "/health", 7611), ("httpGet", "/health", 7611)),
    "cacheserver": (("httpGet", "/healthz", 7622), ("httpGet", "/healthz", 7622)),
    # /health is 503 while no decoder answers: unready, not dead.
    "bridge": (("tcpSocket", None, 7630), ("httpGet", "/health", 7630)),
    "worker": (("httpGet", "/health", 8000), ("httpGet", "/health", 8000)),
    "prefiller": (("httpGet", "/health", 8000), ("httpGet", "/health", 8000)),
    "decoder": (("httpGet", "/health", 8000), ("httpGet", "/health", 8000)),
}


def _probe(c: dict, which: str) -> tuple[str, str | None, int]:
    probe = c[which]
    kind = "httpGet" if "httpGet" in probe else "tcpSocket"
    return kind, probe[kind].get("path"), port_number(c, probe[kind]["port"])


@pytest.mark.parametrize("value_set", SETS)
def test_probes(rendered: dict, value_set: str) -> None:
    off = PORT_OFFSET.get(value_set, 0)
    for w in workloads(rendered[value_set]):
        component = w["metadata"]["labels"]["app.kubernetes.io/component"]
        c = container(w)
        want = tuple((kind, path, port + off) for kind, path, port in PROBES[component])
        assert (_probe(c, "livenessProbe"), _probe(c, "readinessProbe")) == want
        if c["name"] == "vllm":  # model loading: a startup probe holds the others off
            assert _probe(c, "startupProbe") == ("httpGet", "/health", 8000 + off)
            assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300


@pytest.mark.parametrize("value_set", SETS)
def test_services_select_their_pods(rendered: dict, value_set: str) -> None:
    docs = rendered[value_set]
    for svc in of_kind(docs, "Service"):
        selected = [
            w
            for w in workloads(docs)
            if matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(selected) == 1, svc["metadata"]["name"]
        c = container(selected[0])
        for port in svc["spec"]["ports"]:
            port_number(c, port["targetPort"])  # a named port of the container
    for sts in of_kind(docs, "StatefulSet"):
        headless = one(docs, "Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert matches(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    for w in workloads(docs):
        assert matches(
            w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]
        )


def _controller_ports(docs: list) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """(container port name -> number, Service port name -> (port, target number))."""
    deploy = one(docs, "Deployment", full_name("controller"))
    c = container(deploy)
    svc = one(docs, "Service", full_name("controller"))
    return (
        {p["name"]: p["containerPort"] for p in c["ports"]},
        {p["name"]: (p["port"], port_number(c, p["targetPort"])) for p in svc["spec"]["ports"]},
    )


@pytest.mark.parametrize("value_set", SETS)
def test_controller_event_feed_ports(rendered: dict, value_set: str, tmp_path: Path) -> None:
    off = PORT_OFFSET.get(value_set, 0)
    docs = rendered[value_set]
    in_pod, in_svc = _controller_ports(docs)
    want = {"zmq": 7600 + off, "http": 7601 + off, "events": 7602 + off}
    want["events-replay"] = 7603 + off
    assert in_pod == want
    assert in_svc == {name: (n, n) for name, n in want.items()}
    # Where the pod listens is where kvmesh.yaml makes the controller bind the feed.
    cfg = _load(tmp_path, docs)
    assert in_pod["events"] == cfg.controller.events_port
    assert in_pod["events-replay"] == cfg.controller.events_replay_port


@pytest.mark.parametrize("value_set", SETS)
def test_cacheserver_data_port_reaches_the_pod(
    rendered: dict, value_set: str, tmp_path: Path
) -> None:
    # Clients learn the data port from the hello and dial it at the Service's address,
    # so the Service must forward the very port the cache-server binds.
    docs = rendered[value_set]
    found = [w for w in workloads(docs) if w["metadata"]["name"] == full_name("cacheserver")]
    if value_set == "redis-remote":  # no cache-server in this set
        assert not found
        return
    (cache,) = found
    c = container(cache)
    svc = one(docs, "Service", full_name("cacheserver"))
    in_svc = {p["name"]: (p["port"], port_number(c, p["targetPort"])) for p in svc["spec"]["ports"]}
    port = _load(tmp_path, docs).cacheserver.data_port
    assert port == 7623 + PORT_OFFSET.get(value_set, 0)
    assert in_svc["data"] == (port, port) == (port, port_number(c, "data"))


def test_controller_event_feed_off(helm: str, tmp_path: Path) -> None:
    values = {"controller": {"ports": {"events": 0, "eventsReplay": 0}}}
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    in_pod, in_svc = _controller_ports(docs)
    assert set(in_pod) == set(in_svc) == {"zmq", "http"}
    cfg = _load(tmp_path, docs)
    assert (cfg.controller.events_port, cfg.controller.events_replay_port) == (0, 0)
    # The feed without replay: one more port.
    values = {"controller": {"ports": {"eventsReplay": 0}}}
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    assert set(_controller_ports(docs)[0]) == {"zmq", "http", "events"}


@pytest.mark.parametrize("value_set", ["default", "pd"])
def test_pdb_selects_only_the_cacheserver_pods(rendered: dict, value_set: str) -> None:
    docs = rendered[value_set]
    pdb = one(docs, "PodDisruptionBudget", full_name("cacheserver"))
    selector = pdb["spec"]["selector"]["matchLabels"]
    chosen = [
        w["metadata"]["name"]
        for w in workloads(docs)
        if matches(selector, w["spec"]["template"]["metadata"]["labels"])
    ]
    assert chosen == [full_name("cacheserver")]
    if value_set == "pd":
        assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}
        assert one(docs, "StatefulSet", full_name("cacheserver"))["spec"]["replicas"] == 2
    else:
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]


# --- volumes ----------------------------------------------------------------------------


def _mount(c: dict, name: str) -> str:
    (path,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == name]
    return path


def _claim_templates(sts: dict) -> dict[str, dict]:
    return {t["metadata"]["name"]: t["spec"] for t in sts["spec"].get("volumeClaimTemplates", [])}


def test_volumes_default(rendered: dict) -> None:
    docs = rendered["default"]
    cfg = config_dict(docs)
    cache = one(docs, "StatefulSet", full_name("cacheserver"))
    spill = _claim_templates(cache)["spill"]
    assert spill["resources"]["requests"]["storage"] == "10Gi"
    assert spill["accessModes"] == ["ReadWriteOnce"]
    assert _mount(container(cache), "spill") == cfg["cacheserver"]["spill_path"]

    worker = one(docs, "StatefulSet", full_name("worker"))
    disk = _claim_templates(worker)["disk"]
    assert disk["resources"]["requests"]["storage"] == "10Gi"
    assert _mount(container(worker), "disk") == cfg["engine"]["disk"]["path"]
    assert _mount(container(worker), "shm") == "/dev/shm"

    controller = one(docs, "Deployment", full_name("controller"))
    assert controller["spec"]["replicas"] == 1
    assert controller["spec"]["strategy"]["type"] == "Recreate"
    (snapshot,) = [v for v in pod_spec(controller)["volumes"] if v["name"] == "snapshot"]
    claim = snapshot["persistentVolumeClaim"]["claimName"]
    one(docs, "PersistentVolumeClaim", claim)
    snapshot_dir = posixpath.dirname(cfg["controller"]["snapshot_path"])
    assert _mount(container(controller), "snapshot") == snapshot_dir


def test_podman_deployments_and_host_network(rendered: dict, tmp_path: Path) -> None:
    """worker.kind / cacheserver.kind Deployment: no claim templates or headless
    Services, the disk tier and spill on emptyDirs; hostNetwork, hostAliases and podIP
    reach every pod."""
    docs = rendered["podman"]
    cfg = config_dict(docs)
    worker = one(docs, "Deployment", full_name("worker"))
    cache = one(docs, "Deployment", full_name("cacheserver"))
    for w, volume, path in (
        (worker, "disk", cfg["engine"]["disk"]["path"]),
        (cache, "spill", cfg["cacheserver"]["spill_path"]),
    ):
        assert "serviceName" not in w["spec"] and "volumeClaimTemplates" not in w["spec"]
        (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == volume]
        assert vol == {"name": volume, "emptyDir": {"sizeLimit": "1Gi"}}
        assert _mount(container(w), volume) == path
    assert not [s for s in of_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    for w in workloads(docs):
        spec = pod_spec(w)
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        (alias,) = spec["hostAliases"]
        assert alias["ip"] == "127.0.0.1"
        assert {s["metadata"]["name"] for s in of_kind(docs, "Service")} <= set(alias["hostnames"])
        assert env_of(container(w))["POD_IP"]["value"] == "127.0.0.1"
    decoders = _load(tmp_path, docs).bridge.decoders
    assert [d.url for d in decoders] == [f"http://{full_name('worker')}:18000"]
    # shmSize "": podman's own /dev/shm (its Memory emptyDir would be root's, 0755).
    assert "shm" not in {v["name"] for v in pod_spec(worker)["volumes"]}
    assert "shm" not in {m["name"] for m in container(worker)["volumeMounts"]}
    for value_set in ("default", "pd", "redis-remote"):
        for w in workloads(rendered[value_set]):
            spec = pod_spec(w)
            assert "hostNetwork" not in spec and "hostAliases" not in spec
            pod_ip = env_of(container(w))["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert pod_ip == "status.podIP"


def test_volumes_custom_and_off(rendered: dict) -> None:
    worker = one(rendered["redis-remote"], "StatefulSet", full_name("worker"))
    disk = _claim_templates(worker)["disk"]
    assert disk["storageClassName"] == "local-ssd"
    assert disk["resources"]["requests"]["storage"] == "20Gi"

    docs = rendered["pd"]
    cfg = config_dict(docs)
    assert not cfg["engine"]["disk"]["enabled"]
    for role in ("prefiller", "decoder"):
        sts = one(docs, "StatefulSet", full_name(role))
        assert "volumeClaimTemplates" not in sts["spec"]
        assert "disk" not in {m["name"] for m in container(sts)["volumeMounts"]}
    assert (
        _claim_templates(one(docs, "StatefulSet", full_name("cacheserver")))["spill"]["resources"][
            "requests"
        ]["storage"]
        == "20Gi"
    )
    controller = one(docs, "Deployment", full_name("controller"))
    (snapshot,) = [v for v in pod_spec(controller)["volumes"] if v["name"] == "snapshot"]
    assert snapshot == {"name": "snapshot", "emptyDir": {}}
    assert not of_kind(docs, "PersistentVolumeClaim")


# --- containers: image, args, env, resources -------------------------------------------------


@pytest.mark.parametrize("value_set", SETS)
def test_containers(rendered: dict, value_set: str) -> None:
    docs = rendered[value_set]
    config_map = full_name("config")
    for w in workloads(docs):
        component = w["metadata"]["labels"]["app.kubernetes.io/component"]
        c = container(w)
        env = env_of(c)
        assert env["KVMESH_CONFIG"]["value"] == CONFIG_PATH
        assert c["imagePullPolicy"] == "IfNotPresent"
        assert _mount(c, "config") == posixpath.dirname(CONFIG_PATH)
        (config_volume,) = [v for v in pod_spec(w)["volumes"] if v["name"] == "config"]
        assert config_volume["configMap"]["name"] == config_map
        resources = c["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"]
        assert resources["limits"]["memory"]
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert len(annotations["checksum/config"]) == 64
        if c["name"] == "vllm":
            assert c["image"] == "kvmesh-vllm:0.1.0"
            assert c["command"] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
            for name, value in {
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }.items():
                assert env[name]["value"] == value
        else:
            assert c["image"] == "kvmesh:0.1.0"
            assert c["args"] == ["serve", component, "--config", CONFIG_PATH]


KV_ROLES = {"worker": ("kv_both", None), "prefiller": ("kv_producer", "sender"),
            "decoder": ("kv_consumer", "receiver")}  # fmt: skip


@pytest.mark.parametrize("value_set", SETS)
def test_vllm_worker_uses_the_connector(rendered: dict, value_set: str) -> None:
    vllm = [w for w in workloads(rendered[value_set]) if container(w)["name"] == "vllm"]
    assert vllm
    for sts in vllm:
        role = sts["metadata"]["labels"]["app.kubernetes.io/component"]
        c = container(sts)
        args = c["args"]
        assert args[args.index("--model") + 1] == "/models/tiny"
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert args[args.index("--port") + 1] == str(8000 + PORT_OFFSET.get(value_set, 0))
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        kv_role, pd_role = KV_ROLES[role]
        assert transfer == {
            "kv_connector": "KvmeshConnector",
            "kv_connector_module_path": "kvmesh.services.worker.vllm.connector",
            "kv_role": kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config_path": CONFIG_PATH, "instance_id": "$(POD_NAME)"},
        }
        env = _pod_env(c, secrets={"redis-password": "pw"})
        assert env.get("KVMESH_ENGINE__PD__ROLE") == pd_role
        # Besides config keys (KVMESH_<SECTION>__<KEY>, loaded in the tests above) only
        # these KVMESH_* variables: kvmesh ignores them as config.
        not_config = {k for k in env if k.startswith("KVMESH_") and "__" not in k}
        redis = {"KVMESH_REDIS_PASSWORD"} if value_set == "redis-remote" else set()
        assert not_config == {"KVMESH_CONFIG", *redis}


# --- remote tier --------------------------------------------------------------------------


def test_redis_remote(rendered: dict, tmp_path: Path) -> None:
    docs = rendered["redis-remote"]
    cfg = _load(tmp_path, docs)
    assert cfg.engine.remote.enabled
    # The password stays out of the ConfigMap...
    assert cfg.engine.remote.url == "redis://redis-master.redis.svc:6379/2"
    assert "s3cret" not in config_text(docs)
    assert not [d for d in docs if "cacheserver" in d["metadata"]["name"]]
    # ...and reaches the workers from the Secret, through the environment.
    c = container(one(docs, "StatefulSet", full_name("worker")))
    secret = env_of(c)["KVMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "kvmesh-redis", "key": "redis-password"}
    env = _pod_env(c, secrets={"redis-password": "s3cret"})
    pod_cfg = _load(tmp_path, docs, env=env)
    assert pod_cfg.engine.remote.url == "redis://:s3cret@redis-master.redis.svc:6379/2"


@pytest.mark.parametrize(
    ("values", "url"),
    [
        (
            {"backend": "redis-cluster", "redis": {"hosts": ["r-0.r:6379", "r-1.r:6379"]}},
            "redis-cluster://r-0.r:6379,r-1.r:6379",
        ),
        ({"backend": "url", "url": "fs:///mnt/kv"}, "fs:///mnt/kv"),
        ({"backend": "none"}, ""),
    ],
)
def test_other_remote_backends(helm: str, tmp_path: Path, values: dict, url: str) -> None:
    vf = values_file(tmp_path, {"remote": values, "cacheserver": {"enabled": False}})
    docs = parse(render_text(helm, ["-f", str(vf)]))
    cfg = _load(tmp_path, docs)
    assert cfg.engine.remote.url == url
    assert cfg.engine.remote.enabled == bool(url)
    assert not of_kind(docs, "PodDisruptionBudget")


# --- ServiceMonitor -------------------------------------------------------------------------


def test_service_monitor_only_when_enabled(rendered: dict) -> None:
    assert not of_kind(rendered["default"], "ServiceMonitor")
    assert not of_kind(rendered["pd"], "ServiceMonitor")
    docs = rendered["redis-remote"]
    monitors = of_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {
        full_name(c) for c in ("controller", "lookup", "worker")
    }
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["labels"]["release"] == "prometheus"
        assert m["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = m["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
        # It selects exactly one Service, which has the port it scrapes.
        services = [
            s
            for s in of_kind(docs, "Service")
            if matches(m["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
            and endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert len(services) == 1, m["metadata"]["name"]
    controller = one(docs, "ServiceMonitor", full_name("controller"))
    assert controller["spec"]["endpoints"][0]["port"] == "http"  # /metrics on the admin port


@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_service_monitors_scrape_every_component_once(helm: str, tmp_path: Path, kind: str) -> None:
    """Each ServiceMonitor selects exactly one Service that has the port it scrapes,
    whatever worker.kind: a Deployment worker has no headless Service, and its
    engine metrics must still be scraped (once)."""
    values = {"serviceMonitor": {"enabled": True}, "worker": {"kind": kind},
              "cacheserver": {"kind": kind}, "bridge": {"enabled": True},
              "config": {"bridge": {"decoders": [{"url": "http://d:8000"}]}}}  # fmt: skip
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    monitors = of_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {
        full_name(c) for c in ("controller", "lookup", "cacheserver", "bridge", "worker")
    }
    for m in monitors:
        (endpoint,) = m["spec"]["endpoints"]
        services = [
            s
            for s in of_kind(docs, "Service")
            if matches(m["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
            and endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert len(services) == 1, (
            m["metadata"]["name"],
            [s["metadata"]["name"] for s in services],
        )
        # ... and the port reaches the container port the process serves /metrics on.
        (svc,) = services
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)]
        pods = [w for w, lab in zip(workloads(docs), labels, strict=True)
                if matches(svc["spec"]["selector"], lab)]  # fmt: skip
        assert pods and port_number(container(pods[0]), port["targetPort"]) == port["port"]


# --- disaggregated prefill ------------------------------------------------------------------


def test_pd_bridge_backends(rendered: dict, tmp_path: Path) -> None:
    docs = rendered["pd"]
    cfg = _load(tmp_path, docs)
    decoder = one(docs, "StatefulSet", full_name("decoder"))
    prefiller = one(docs, "StatefulSet", full_name("prefiller"))

    def pod_host(sts: dict, i: int) -> str:
        return f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.svc"

    assert [p.url for p in cfg.bridge.prefillers] == [f"http://{pod_host(prefiller, 0)}:8000"]
    assert [(d.url, d.kv_endpoints) for d in cfg.bridge.decoders] == [
        (f"http://{pod_host(decoder, i)}:8000", [f"tcp://{pod_host(decoder, i)}:7650"])
        for i in range(2)
    ]
    assert decoder["spec"]["replicas"] == 2 and prefiller["spec"]["replicas"] == 1
    # Decoders' DNS names resolve before they are ready (the bridge watches them start).
    assert one(docs, "Service", decoder["spec"]["serviceName"])["spec"]["publishNotReadyAddresses"]
    assert cfg.bridge.prefill_timeout_s == 20 and cfg.bridge.decode_timeout_s == 90
    assert cfg.engine.layerwise and cfg.engine.pd.max_receive_fraction == 0.25
    assert one(docs, "Service", full_name("bridge"))["spec"]["type"] == "NodePort"
    cache = one(docs, "StatefulSet", full_name("cacheserver"))
    assert cfg.cacheserver.lm_enabled and port_number(container(cache), "lm") == 7621


def test_pd_bridge_kv_routing(helm: str, tmp_path: Path) -> None:
    """KV-aware routing (config.bridge.lookup_url) with pd.enabled: kvmesh refuses a
    lookup_url unless every backend has its instance_id, and the chart owns the pd
    backends, so it must name each one as its pod's connector does ($(POD_NAME))."""
    lookup = f"tcp://{full_name('lookup')}:7610"
    vf = values_file(tmp_path, {"config": {"bridge": {"lookup_url": lookup}}})
    docs = parse(render_text(helm, [*VALUE_SETS["pd"], "-f", str(vf)]))
    cfg = _load(tmp_path, docs)  # refused before: "[0].instance_id ... required"
    assert cfg.bridge.lookup_url == lookup
    for role, backends in (("prefiller", cfg.bridge.prefillers), ("decoder", cfg.bridge.decoders)):
        sts = one(docs, "StatefulSet", full_name(role))
        transfer = json.loads(
            container(sts)["args"][container(sts)["args"].index("--kv-transfer-config") + 1]
        )
        assert transfer["kv_connector_extra_config"]["instance_id"] == "$(POD_NAME)"
        # A StatefulSet's pod i is named <statefulset>-i: the id its connector registers.
        pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
        assert [b.instance_id for b in backends] == pods
        assert all(
            b.url.startswith(f"http://{pod}.") for b, pod in zip(backends, pods, strict=True)
        )


# --- NOTES.txt ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", SETS)
def test_notes_render(helm: str, value_set: str, tmp_path: Path) -> None:
    """NOTES.txt renders (`helm template` skips it, and `helm install --dry-run` wants a
    cluster): a copy of the chart renders it inside a ConfigMap."""
    chart = tmp_path / "kvmesh"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "notes" -}}' + notes + "{{- end -}}"
    )
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "notes" . | quote }}}\n'
    )
    args = [*VALUE_SETS[value_set], "--show-only", "templates/notes.yaml"]
    text = parse(render_text(helm, args, chart=chart))[0]["data"]["notes"]
    assert (
        f"port-forward svc/{full_name('controller')} {7601 + PORT_OFFSET.get(value_set, 0)}" in text
    )
    off = PORT_OFFSET.get(value_set, 0)
    feed = f"--controller {full_name('controller')} --events-port {7602 + off}"
    assert f"kvmesh events {feed} --replay-port {7603 + off}" in text
    if value_set == "pd":
        assert f"svc/{full_name('bridge')} 7630" in text
    if value_set == "redis-remote":
        assert "redis://redis-master.redis.svc:6379/2" in text and "ServiceMonitors" in text
    if value_set == "secure":
        assert "CURVE: on" in text and "Secret kvmesh-curve" in text
        assert "Authorization: Bearer" in text and full_name("dashboard") in text
    else:
        assert "CURVE" not in text and "Bearer" not in text


# --- the values schema and the templates' own checks ---------------------------------------

BAD_VALUES = [
    # (values, what the message must name)
    ({"lookup": {"replicas": "two"}}, "lookup.replicas"),
    ({"controller": {"replcas": 1}}, "replcas"),
    ({"worker": {"ports": {"http": "8000"}}}, "worker.ports.http"),
    ({"remote": {"backend": "memcached"}}, "remote.backend"),
    ({"serviceMonitor": {"enabled": "yes"}}, "serviceMonitor.enabled"),
    ({"cacheserver": {"spill": {"size": "lots"}}}, "cacheserver.spill.size"),
    ({"typo_top_level": True}, "typo_top_level"),
    ({"worker": {"kind": "DaemonSet"}}, "worker.kind"),
    ({"hostAliases": [{"ip": "127.0.0.1"}]}, "hostAliases"),
    # config: is checked against kvmesh's own schema (k8s/tools/config_schema.py).
    ({"config": {"engine": {"chunk_sise": 256}}}, "chunk_sise"),
    ({"config": {"engine": {"chunk_size": "big"}}}, "config.engine.chunk_size"),
    ({"config": {"engine": {"chunk_size": 0}}}, "config.engine.chunk_size"),
    ({"config": {"cacheserver": {"max_memory": "lots"}}}, "config.cacheserver.max_memory"),
    ({"config": {"engine": {"l1": {"eviction_policy": "lifo"}}}}, "engine.l1.eviction_policy"),
    ({"config": {"enigne": {}}}, "enigne"),
    ({"security": {"existingSecret": True}}, "security.existingSecret"),
    ({"security": {"existingSecert": "x"}}, "existingSecert"),
    ({"security": {"httpTokenSecret": {"name": "t", "key": ""}}}, "security.httpTokenSecret.key"),
    ({"grafanaDashboard": {"enabled": "yes"}}, "grafanaDashboard.enabled"),
    ({"controller": {"ports": {"events": -1}}}, "controller.ports.events"),
    ({"controller": {"ports": {"eventsReplay": 70000}}}, "controller.ports.eventsReplay"),
    # IPv6 only in brackets: "::1:6379" cannot say where the address ends.
    ({"remote": {"redis": {"hosts": ["::1:6379"]}}}, "remote.redis.hosts.0"),
    ({"remote": {"redis": {"hosts": ["redis:6379/0"]}}}, "remote.redis.hosts.0"),
    ({"remote": {"redis": {"hosts": ["[::1:6379"]}}}, "remote.redis.hosts.0"),
    ({"cacheserver": {"pdb": {"minAvailable": -1}}}, "cacheserver.pdb.minAvailable"),
    ({"tmp": {"medium": "HugePages"}}, "tmp.medium"),
    ({"tmp": {"sizeLimit": "lots"}}, "tmp.sizeLimit"),
    ({"worker": {"home": {"enable": False}}}, "enable"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "named"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_schema_rejects_with_the_key_named(
    helm: str, tmp_path: Path, values: dict, named: str
) -> None:
    vf = values_file(tmp_path, values)
    for cmd in (
        [helm, *template_args(["-f", str(vf)])],
        [helm, "lint", "--strict", str(CHART), "-f", str(vf)],
    ):
        proc = run(cmd)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"{cmd[1]} accepted {values}"
        assert "values don't meet the specifications of the schema" in out, out
        assert named in out, out


TEMPLATE_ERRORS = [
    ({"config": {"controller": {"port": 7700}}},
     "config.controller.port is set by the chart; set controller.ports.zmq instead"),
    ({"config": {"engine": {"remote": {"url": "redis://x:1"}}}}, "config.engine.remote.url"),
    ({"config": {"engine": {"disk": {"path": "/x"}}}}, "config.engine.disk.path"),
    ({"remote": {"backend": "redis"}, "cacheserver": {"enabled": False}}, "remote.redis.hosts"),
    ({"remote": {"backend": "redis", "redis": {"hosts": ["a:1", "b:2"]}}}, "redis-cluster"),
    ({"remote": {"backend": "url"}}, "remote.url"),
    ({"cacheserver": {"enabled": False}}, "remote.backend is cacheserver"),
    ({"bridge": {"enabled": True}}, "bridge.enabled needs decoders"),
    ({"pd": {"enabled": True}, "worker": {"kind": "Deployment"}},
     "pd.enabled needs worker.kind StatefulSet"),
    ({"security": {"existingSecret": "k"}, "config": {"security": {"server_key": "/k"}}},
     "config.security.server_key is set by the chart; set security.existingSecret"),
    ({"security": {"httpTokenSecret": {"name": "t"}},
      "config": {"security": {"http_token_file": "/t"}}},
     "config.security.http_token_file is set by the chart; set security.httpTokenSecret"),
    ({"controller": {"ports": {"events": 0}}},
     "controller.ports.eventsReplay needs controller.ports.events"),
    ({"config": {"controller": {"events_port": 7700}}},
     "config.controller.events_port is set by the chart; set controller.ports.events instead"),
    ({"tmp": {"enabled": False}}, "tmp.enabled false with securityContext.readOnlyRootFilesystem"),
    ({"worker": {"home": {"enabled": False}}},
     "worker.home.enabled false with securityContext.readOnlyRootFilesystem"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "named"), TEMPLATE_ERRORS, ids=[n for _, n in TEMPLATE_ERRORS])
def test_templates_refuse_inconsistent_values(
    helm: str, tmp_path: Path, values: dict, named: str
) -> None:
    proc = run([helm, *template_args(["-f", str(values_file(tmp_path, values))])])
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr


def test_config_rule_errors_surface_in_kvmesh_validation(helm: str, tmp_path: Path) -> None:
    """Rules between two keys are kvmesh's own: the chart renders them, kvmesh refuses
    them with the key named (as every pod would at start-up)."""
    vf = values_file(tmp_path, {"config": {"cacheserver": {"max_value_size": "2GiB"}}})
    docs = parse(render_text(helm, ["-f", str(vf)]))
    with pytest.raises(ConfigError, match=r"cacheserver\.max_value_size"):
        _load(tmp_path, docs)


def test_config_schema_matches_kvmesh() -> None:
    """values.schema.json's config definitions are generated from common/config/schema.py."""
    proc = run([sys.executable, str(ROOT / "k8s" / "tools" / "config_schema.py"), "--check"])
    assert proc.returncode == 0, proc.stderr


def test_values_yaml_is_schema_valid_and_documented() -> None:
    """Every top-level value is in the schema, and the schema forbids others."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) == set(schema["properties"])


# --- security: CURVE keys and the HTTP token from Secrets -----------------------------------

KEYS_DIR = "/etc/kvmesh-keys"
TOKEN_DIR = "/etc/kvmesh-token"


def _secret_volumes(w: dict) -> dict[str, dict]:
    """volume name -> its secret source, of a workload's pod."""
    return {v["name"]: v["secret"] for v in pod_spec(w).get("volumes", []) if "secret" in v}


@pytest.mark.parametrize("value_set", SETS)
def test_security_secrets_mounted_read_only_in_every_pod(rendered: dict, value_set: str) -> None:
    docs = rendered[value_set]
    secure = value_set == "secure"
    assert len(workloads(docs)) >= (6 if secure else 3)
    for w in workloads(docs):
        secrets = _secret_volumes(w)
        c = container(w)
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        if not secure:
            assert "curve-keys" not in secrets and "curve-keys" not in mounts, w["kind"]
            continue
        name = w["metadata"]["name"]
        assert secrets["curve-keys"]["secretName"] == "kvmesh-curve", name
        assert secrets["http-token"]["secretName"] == "kvmesh-admin-token", name
        assert secrets["http-token"]["items"] == [{"key": "token", "path": "token"}], name
        for vol in ("curve-keys", "http-token"):
            # Owner and group read only: never world-readable secret keys.
            assert secrets[vol]["defaultMode"] == 0o440, (name, vol)
            assert mounts[vol]["readOnly"] is True, (name, vol)
        assert mounts["curve-keys"]["mountPath"] == KEYS_DIR
        assert mounts["http-token"]["mountPath"] == TOKEN_DIR
        # Not inside the ConfigMap's read-only volume (a mount point can't be made there).
        assert not KEYS_DIR.startswith(mounts["config"]["mountPath"] + "/")


@pytest.mark.parametrize("value_set", SETS)
def test_security_config_points_at_the_mounted_keys(
    rendered: dict, value_set: str, tmp_path: Path
) -> None:
    sec = _load(tmp_path, rendered[value_set]).security
    if value_set != "secure":
        assert not sec.curve and not sec.http_token_file
        return
    assert sec.curve
    assert sec.server_key == f"{KEYS_DIR}/server.key_secret"
    assert sec.client_key == f"{KEYS_DIR}/client.key_secret"
    assert sec.allowed_clients == KEYS_DIR
    assert sec.http_token_file == f"{TOKEN_DIR}/token"


def test_documented_secret_layout_loads_with_kvmesh(rendered: dict, tmp_path: Path) -> None:
    """The keys `kvmesh keys generate` writes, laid out as the documented
    `kubectl create secret` puts them in the mount (plus the kubelet's ..data
    entries), load as every pod loads them: servers and clients both."""
    import msgspec
    from click.testing import CliRunner

    from kvmesh.common.transport.curve import load_curve
    from kvmesh.services.cli.main import cli

    gen = tmp_path / "generated"
    for name in ("server", "client", "admin"):
        out = CliRunner().invoke(cli, ["keys", "generate", str(gen), "--name", name])
        assert out.exit_code == 0, out.output
    mount = tmp_path / "mount"
    data = mount / "..2026_01_01_00_00_00.000000000"
    data.mkdir(parents=True)
    (mount / "..data").symlink_to(data.name)
    for f in ("server.key_secret", "client.key_secret", "client.key", "admin.key"):
        (data / f).write_bytes((gen / f).read_bytes())
        (mount / f).symlink_to(f"..data/{f}")
    sec = _load(tmp_path, rendered["secure"]).security
    local = msgspec.structs.replace(
        sec,
        server_key=sec.server_key.replace(KEYS_DIR, str(mount)),
        client_key=sec.client_key.replace(KEYS_DIR, str(mount)),
        allowed_clients=sec.allowed_clients.replace(KEYS_DIR, str(mount)),
        http_token_file="",
    )
    keys = load_curve(local, server=True, client=True)
    assert keys is not None and keys.server_secret and keys.client_secret
    public = {
        (gen / f"{n}.key").read_text().split('public-key = "')[1].split('"')[0].encode()
        for n in ("client", "admin")
    }
    assert keys.allowed == public  # every *.key in the Secret, and no other file


def test_grafana_dashboard_configmap(rendered: dict) -> None:
    dash = DASHBOARD_FILE.read_text()
    for value_set in SETS:
        maps = [d for d in of_kind(rendered[value_set], "ConfigMap")
                if d["metadata"]["name"] == full_name("dashboard")]  # fmt: skip
        if value_set != "secure":
            assert not maps, value_set
            continue
        (cm,) = maps
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["labels"]["team"] == "inference"
        assert json.loads(cm["data"]["kvmesh.json"]) == json.loads(dash)


# --- pod security: non-root, no capabilities ------------------------------------------------

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _image_uid() -> int:
    """The uid docker/Dockerfile runs its images as (ARG KVMESH_UID)."""
    (line,) = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ARG KVMESH_UID=")]
    return int(line.split("=", 1)[1])


@pytest.mark.parametrize("value_set", SETS)
def test_every_pod_runs_as_non_root_without_capabilities(rendered: dict, value_set: str) -> None:
    uid = _image_uid()
    assert uid != 0
    docs = rendered[value_set]
    assert workloads(docs)
    for w in workloads(docs):
        name = w["metadata"]["name"]
        pod = pod_spec(w)["securityContext"]
        assert pod["runAsNonRoot"] is True, name
        # The image's own uid: its directories (HOME, /var/lib/kvmesh) are that uid's.
        assert (pod["runAsUser"], pod["runAsGroup"]) == (uid, uid), name
        # Volumes (PVCs, emptyDirs) and the 0440 Secrets belong to the pod's group.
        assert pod["fsGroup"] == uid, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod_spec(w)["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert not sc.get("privileged"), (name, c["name"])
            assert sc.get("runAsUser", uid) != 0 and sc.get("runAsNonRoot", True), name


def test_security_contexts_can_be_changed(helm: str, tmp_path: Path) -> None:
    """Values merge into the defaults; null drops a key (a cluster that assigns uids
    itself, as OpenShift does), a capability can be added back."""
    values = {
        "podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None,
                               "fsGroupChangePolicy": None},
        "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
    }  # fmt: skip
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    for w in workloads(docs):
        assert pod_spec(w)["securityContext"] == {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert container(w)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        }


# --- read-only root filesystem: every path a process writes is a volume ---------------------


def _writable_mount(c: dict, path: str) -> str | None:
    """The mountPath of the writable volume holding path, None when it is on the root
    filesystem (or under a read-only mount)."""

    def holds(mount: str) -> bool:
        return path == mount or path.startswith(mount.rstrip("/") + "/")

    mounts = [m for m in c["volumeMounts"] if holds(m["mountPath"])]
    if not mounts:
        return None
    inner = max(mounts, key=lambda m: len(m["mountPath"]))
    return None if inner.get("readOnly") else inner["mountPath"]


def _written_paths(c: dict, docs: list, tmp_path: Path) -> dict[str, str]:
    """What the container's process writes (deploy_helm.written_paths), from kvmesh.yaml
    with the pod's KVMESH_* variables, the image's environment and the pod's own."""
    vllm = c["name"] == "vllm"
    env = {**image_env("worker" if vllm else "services"), **_pod_env(c, {"redis-password": "x"})}
    return written_paths(c["name"], vllm, _load(tmp_path, docs, env=env), env)


@pytest.mark.parametrize("value_set", SETS)
def test_read_only_root_filesystem_and_every_written_path_is_a_volume(
    rendered: dict, value_set: str, tmp_path: Path
) -> None:
    docs = rendered[value_set]
    for w in workloads(docs):
        for c in pod_spec(w)["containers"]:
            name = (w["metadata"]["name"], c["name"])
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
            volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
            claims = _claim_templates(w)
            for path, why in _written_paths(c, docs, tmp_path).items():
                mount = _writable_mount(c, path)
                assert mount is not None, f"{name}: {path} ({why}) is on no writable volume"
                (volume,) = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == mount]
                assert volume in volumes or volume in claims, (name, volume)
            (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert volumes[tmp["name"]]["emptyDir"] == {"sizeLimit": "1Gi"}, name
            if c["name"] == "vllm":
                (home,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/home/kvmesh"]
                assert volumes[home["name"]]["emptyDir"] == {}, name


def test_read_only_root_filesystem_can_be_turned_off(helm: str, tmp_path: Path) -> None:
    """readOnlyRootFilesystem false, tmp and worker.home off: the image's own /tmp and
    HOME; tmp on a tmpfs and a sized HOME when asked."""
    values = {"securityContext": {"readOnlyRootFilesystem": False}, "tmp": {"enabled": False},
              "worker": {"home": {"enabled": False}}}  # fmt: skip
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    assert workloads(docs)
    for w in workloads(docs):
        c = container(w)
        assert c["securityContext"]["readOnlyRootFilesystem"] is False
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert not {"tmp", "home"} & {v["name"] for v in pod_spec(w)["volumes"]}
        assert not {"/tmp", "/home/kvmesh"} & {m["mountPath"] for m in c["volumeMounts"]}

    values = {
        "tmp": {"medium": "Memory", "sizeLimit": ""},
        "worker": {"home": {"sizeLimit": "20Gi"}},
    }
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    for w in workloads(docs):
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        assert volumes["tmp"]["emptyDir"] == {"medium": "Memory"}
        if container(w)["name"] == "vllm":
            assert volumes["home"]["emptyDir"] == {"sizeLimit": "20Gi"}
        else:
            assert "home" not in volumes


# --- PodDisruptionBudget: minAvailable 0 is a count -----------------------------------------


@pytest.mark.parametrize(
    ("pdb", "want"),
    [
        ({"minAvailable": 0}, {"minAvailable": 0}),
        ({"minAvailable": 0, "maxUnavailable": 2}, {"minAvailable": 0}),
        ({"minAvailable": "0%"}, {"minAvailable": "0%"}),
        ({"minAvailable": 2}, {"minAvailable": 2}),
        ({"minAvailable": "50%"}, {"minAvailable": "50%"}),
        ({"minAvailable": ""}, {"maxUnavailable": 1}),
        ({"minAvailable": "", "maxUnavailable": 0}, {"maxUnavailable": 0}),
    ],
    ids=["0", "0-over-max", "0%", "2", "50%", "unset", "max-0"],
)
def test_pdb_min_available_as_written(helm: str, tmp_path: Path, pdb: dict, want: dict) -> None:
    values = {"cacheserver": {"pdb": pdb}}
    docs = parse(render_text(helm, ["-f", str(values_file(tmp_path, values))]))
    spec = one(docs, "PodDisruptionBudget", full_name("cacheserver"))["spec"]
    assert {k: v for k, v in spec.items() if k != "selector"} == want
    # --set gives helm an int64 where a values file gives a float64: the same answer.
    if pdb == {"minAvailable": 0}:
        docs = parse(render_text(helm, ["--set", "cacheserver.pdb.minAvailable=0"]))
        spec = one(docs, "PodDisruptionBudget", full_name("cacheserver"))["spec"]
        assert spec["minAvailable"] == 0 and "maxUnavailable" not in spec


# --- remote.redis.hosts: what kvmesh's loader and connectors accept -------------------------


@pytest.mark.parametrize(
    ("backend", "hosts", "url", "nodes"),
    [
        ("redis", ["[::1]:6379"], "redis://[::1]:6379/0", [("::1", 6379)]),
        ("redis", ["redis-master.redis.svc"], "redis://redis-master.redis.svc/0",
         [("redis-master.redis.svc", 6379)]),
        ("redis-cluster", ["[::1]:7000", "[fd00::2]:7001", "10.0.0.3:7002", "redis-3"],
         "redis-cluster://[::1]:7000,[fd00::2]:7001,10.0.0.3:7002,redis-3",
         [("::1", 7000), ("fd00::2", 7001), ("10.0.0.3", 7002), ("redis-3", 6379)]),
    ],
    ids=["redis-ipv6", "redis-no-port", "cluster-mixed"],
)  # fmt: skip
def test_redis_hosts_ipv6_and_default_port(
    helm: str, tmp_path: Path, backend: str, hosts: list[str], url: str, nodes: list
) -> None:
    from redis.asyncio import Redis

    from kvmesh.common.transport.tcp_address import host_ports

    values = {"remote": {"backend": backend, "redis": {"hosts": hosts}},
              "cacheserver": {"enabled": False}}  # fmt: skip
    vf = values_file(tmp_path, values)
    proc = run([helm, "lint", "--strict", str(CHART), "-f", str(vf)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = _load(tmp_path, parse(render_text(helm, ["-f", str(vf)])))
    assert cfg.engine.remote.enabled and cfg.engine.remote.url == url
    # What the worker's Redis connectors make of the URL: the nodes they dial.
    rest = url.partition("://")[2].split("/", 1)[0]
    if backend == "redis-cluster":
        assert host_ports(rest, 6379) == nodes
    else:
        kw = Redis.from_url(url).connection_pool.connection_kwargs
        # No port in the URL: redis-py's connection default, 6379.
        assert [(kw["host"], kw.get("port", 6379))] == nodes
