#!/usr/bin/env bash
# Start (or find) a private Docker daemon for building and running kvmesh images on a
# machine with no running engine and no registry (shared/RECIPES.md), and print the
# DOCKER_HOST to use. Idempotent. `docker/dockerd.sh stop` stops it.
#   export DOCKER_HOST=$(docker/dockerd.sh)
set -euo pipefail
ROOT=${KVMESH_DOCKER_ROOT:-/var/lib/kvmesh-docker}
RUN=${KVMESH_DOCKER_RUN:-/run/kvmesh-docker}
SOCK="unix://$RUN/docker.sock"

running() { DOCKER_HOST=$SOCK docker info >/dev/null 2>&1; }

if [ "${1:-start}" = stop ]; then
  if [ -f "$RUN/docker.pid" ]; then
    kill "$(cat "$RUN/docker.pid")" 2>/dev/null || true
    for _ in $(seq 50); do [ -f "$RUN/docker.pid" ] || break; sleep 0.2; done
  fi
  exit 0
fi

if ! running; then
  command -v dockerd >/dev/null || { echo "dockerd missing: run scripts/setup.sh" >&2; exit 1; }
  mkdir -p "$ROOT" "$RUN"
  # No iptables and no default bridge: this machine's sandbox allows neither; compose's
  # CI override runs the containers on the host network (docker/compose/ci.yaml).
  nohup dockerd --data-root "$ROOT/data" --exec-root "$RUN/exec" -H "$SOCK" \
    --pidfile "$RUN/docker.pid" --iptables=false --bridge=none \
    >"$ROOT/dockerd.log" 2>&1 &
  for _ in $(seq 100); do running && break; sleep 0.3; done
  running || { tail -20 "$ROOT/dockerd.log" >&2; echo "dockerd did not start" >&2; exit 1; }
fi
echo "$SOCK"
