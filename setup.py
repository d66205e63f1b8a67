"""Lists the packages: each top-level source folder installs under `kvmesh.`, and the
optional native helpers.

pyproject.toml's package-dir maps the folders; this file only enumerates their
sub-packages, which a static `packages.find` cannot prefix.

The C helpers are optional: without a C compiler (or libxxhash) the build goes on
without them and the Python paths serve. `kvmesh.gpu_ext._block_copy`
(gpu_ext/csrc/block_copy.c) moves whole KV blocks for the CPU copier;
`kvmesh.common._chain_hash` (common/csrc/chain_hash.c) computes the token database's
chained hashes; `kvmesh.common._chunk_ints` (common/csrc/chunk_ints.c) folds chunk keys to
chunk ints and packs them for snapshots and the wire.
"""

from setuptools import Extension, find_packages, setup

_ROOTS = ("common", "services", "gpu_ext")
packages = ["kvmesh"] + [
    f"kvmesh.{name}" for name in find_packages(include=[f"{root}*" for root in _ROOTS])
]

native = [
    Extension(
        "kvmesh.gpu_ext._block_copy",
        ["gpu_ext/csrc/block_copy.c"],
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
        optional=True,
    ),
    # libxxhash0 is on every Debian/Ubuntu system (apt depends on it); linked by its
    # soname, so the -dev package is not needed.
    Extension(
        "kvmesh.common._chain_hash",
        ["common/csrc/chain_hash.c"],
        extra_compile_args=["-O3"],
        libraries=[":libxxhash.so.0"],
        optional=True,
    ),
    Extension(
        "kvmesh.common._chunk_ints",
        ["common/csrc/chunk_ints.c"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
]

setup(packages=packages, ext_modules=native)
