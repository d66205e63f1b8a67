"""`kvmesh doctor`'s checks of this host's own resources: NIXL/UCX, the disk tier's
directory, memory sizing. Each returns Checks (services/cli/doctor_cmd.py prints them)
and blocks (a child process, file I/O): call them off the event loop."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from kvmesh.common.config import KvmeshConfig
from kvmesh.services.cli.status_cmd import human_size

Level = Literal["ok", "warn", "fail"]
ALIGN = 4096
# NIXL's import pulls native libraries; on a loaded 2-core host it has taken seconds.
NIXL_TIMEOUT_S = 30.0


@dataclass
class Check:
    name: str
    level: Level
    why: str


_NIXL_PROBE = (
    "import os\n"
    "from kvmesh.common.transport.channel import nixl_available\n"
    "assert nixl_available(), 'nixl_cu13 does not import'\n"
    "from kvmesh.common.transport.channel_nixl import _new_agent\n"
    "_new_agent('kvmesh-doctor')\n"
    "print(os.environ.get('UCX_TLS', ''))\n"
)


def check_nixl() -> list[Check]:
    fallback = "P2P and PD use the ZMQ channel instead (slower; p2p.channel: zmq silences this)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _NIXL_PROBE],
            capture_output=True,
            text=True,
            timeout=NIXL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return [Check("nixl", "warn", f"NIXL did not start in {NIXL_TIMEOUT_S:g}s; {fallback}")]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["exit " + str(proc.returncode)])[-1]
        return [Check("nixl", "warn", f"NIXL/UCX unusable: {last[:200]}; {fallback}")]
    tls = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "default"
    return [
        Check("nixl", "ok", "nixl_cu13 imports"),
        Check("ucx", "ok", f"the UCX backend starts with UCX_TLS={tls}"),
    ]


def check_native() -> list[Check]:
    """Whether the C helpers were built with the package (they are optional: without
    them the same results come from slower Python/torch paths)."""
    from kvmesh.common import chunk_holders, tokendb
    from kvmesh.gpu_ext import native_copy

    rebuild = "reinstall kvmesh where a C compiler (and libxxhash0) is present"
    helpers = [
        ("block copier", native_copy.available(), "CPU KV copies use torch (~2x slower)"),
        ("token hasher", tokendb.native_chain_available(), "keys hashed in Python (2-5x slower)"),
        (
            "chunk-int helper",
            chunk_holders.native_packer_available(),
            "the controller's keys and snapshots handled in Python (1.5-3x slower)",
        ),
    ]
    return [
        Check("native", "ok", f"the C {name} is built")
        if built
        else Check("native", "warn", f"the C {name} is not built: {cost}; {rebuild}")
        for name, built, cost in helpers
    ]


def _o_direct_error(directory: Path) -> str:
    """ "" when an aligned O_DIRECT write works in directory, else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    fd, name = tempfile.mkstemp(prefix=".kvmesh-doctor-", dir=directory)
    os.close(fd)
    # An anonymous mmap is page-aligned: the buffer alignment O_DIRECT asks for.
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(name)


def check_disk(cfg: KvmeshConfig) -> list[Check]:
    d = cfg.engine.disk
    if not d.enabled:
        return [Check("disk", "ok", "engine.disk is off: nothing to check")]
    path = Path(d.path)
    if not path.is_dir():
        return [
            Check(
                "disk",
                "fail",
                f"engine.disk.path {path} does not exist or is not a "
                "directory; create it (mkdir -p) or fix the path",
            )
        ]
    try:
        fd, name = tempfile.mkstemp(prefix=".kvmesh-doctor-", dir=path)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return [
            Check(
                "disk",
                "fail",
                f"engine.disk.path {path} is not writable "
                f"({exc.strerror}); chown/chmod it for this user",
            )
        ]
    out = [Check("disk", "ok", f"{path} exists and is writable")]
    usage = shutil.disk_usage(path)
    room = usage.free + _du(path)
    want = int(d.max_size)
    if room < want:
        out.append(
            Check(
                "disk",
                "warn",
                f"{path} has {human_size(room)} free for a max_size of "
                f"{human_size(want)}; lower engine.disk.max_size or free space",
            )
        )
    else:
        out.append(Check("disk", "ok", f"{human_size(room)} free for max_size {human_size(want)}"))
    why = _o_direct_error(path)
    if not why:
        out.append(Check("o_direct", "ok", f"aligned O_DIRECT writes work in {path}"))
    elif d.o_direct:
        out.append(
            Check(
                "o_direct",
                "warn",
                f"O_DIRECT fails in {path} ({why}; tmpfs before Linux 6.6 and some "
                "overlay or network filesystems refuse it): set engine.disk.o_direct: false",
            )
        )
    else:
        out.append(Check("o_direct", "ok", f"O_DIRECT unsupported in {path} ({why}); it is off"))
    return out


def _du(path: Path) -> int:
    """Bytes of files already under path: a cache refilling its own space needs no more."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def check_memory(cfg: KvmeshConfig) -> list[Check]:
    avail = psutil.virtual_memory().available
    l1 = cfg.engine.l1
    out = []
    need = int(l1.max_size) + int(l1.reserve)
    sizes = f"l1.max_size {human_size(int(l1.max_size))} + reserve {human_size(int(l1.reserve))}"
    if need <= avail:
        out.append(Check("memory", "ok", f"{sizes} fits in {human_size(avail)} available"))
    elif int(l1.max_size) > avail - int(l1.reserve) and avail > int(l1.reserve):
        # The pool shrinks to what is left, so this is a smaller cache, not a failure.
        out.append(
            Check(
                "memory",
                "warn",
                f"{sizes} exceeds {human_size(avail)} available: "
                "L1 will be smaller than configured; lower engine.l1.max_size",
            )
        )
    else:
        out.append(
            Check(
                "memory",
                "fail",
                f"{sizes}: {human_size(avail)} available leaves "
                "nothing for L1; lower engine.l1.reserve or free memory",
            )
        )
    mm = int(cfg.cacheserver.max_memory)
    total = psutil.virtual_memory().total
    if mm > total:
        out.append(
            Check(
                "memory",
                "warn",
                f"cacheserver.max_memory {human_size(mm)} exceeds "
                f"this host's {human_size(total)}; lower it if the cache-server runs here",
            )
        )
    return out
