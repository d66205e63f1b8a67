"""Lists the packages: each top-level source folder installs under `kvmesh.`.

pyproject.toml's package-dir maps the folders; this file only enumerates their
sub-packages, which a static `packages.find` cannot prefix.
"""

from setuptools import find_packages, setup

_ROOTS = ("common", "services", "gpu_ext")
packages = ["kvmesh"] + [
    f"kvmesh.{name}" for name in find_packages(include=[f"{root}*" for root in _ROOTS])
]

setup(packages=packages)
