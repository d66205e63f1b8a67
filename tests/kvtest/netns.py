"""A network namespace as a second host, joined to this one by a veth pair (needs root
and `ip`, as CI has)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def veth_namespace(
    prefix: str, host_ip: str, ns_ip: str, prefix_len: int
) -> Iterator[tuple[str, str]]:
    """A namespace named prefix + a tag of this process, `ns_ip/prefix_len` on its end
    of the pair and `host_ip` on ours (IPv4 or IPv6 alike; `{}` in them is the tag);
    yields (its name, its address). Torn down on the way out, a failed set-up too."""
    tag = os.getpid() % 250 + 1
    name, host_if, ns_if = f"{prefix}{tag}", f"{prefix}{tag}h", f"{prefix}{tag}n"
    ns_ip, host_ip = ns_ip.format(tag), host_ip.format(tag)
    # nodad: IPv6 addresses usable at once, not after duplicate detection.
    v6 = ["nodad"] if ":" in ns_ip else []
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
    commands = (
        ["ip", "netns", "add", name],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", name],
        ["ip", "addr", "add", f"{host_ip}/{prefix_len}", "dev", host_if, *v6],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/{prefix_len}", "dev",
         ns_if, *v6],
        ["ip", "netns", "exec", name, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    )  # fmt: skip
    try:
        for cmd in commands:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            # Fails loudly: the test needs root and `ip` (iproute2), as CI has.
            assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        yield name, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
