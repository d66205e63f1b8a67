"""Lists the packages: each top-level source folder installs under `kvmesh.`, and the
optional native helpers.

pyproject.toml's package-dir maps the folders; this file only enumerates their
sub-packages, which a static `packages.find` cannot prefix.

`kvmesh.gpu_ext._block_copy` (gpu_ext/csrc/block_copy.c) is optional: without a C
compiler the build goes on without it and the CPU copier uses torch alone
(gpu_ext/native_copy.py reports which).
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
    )
]

setup(packages=packages, ext_modules=native)
