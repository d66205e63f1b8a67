"""A bare TCP connection to the cache-server's lm:// listener, for the tests that speak
the protocol by hand (the header layouts are in kvmesh.common.protocol.lmcache_lm)."""

from __future__ import annotations

import socket
import time


class LmConnection:
    """Connects with TCP_NODELAY and a 5 s timeout; subclasses add how they send."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), 5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(5)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def closed_within(self, seconds: float = 5.0) -> bool:
        """Whether the server closes the connection within seconds; replies it sends
        first (a 400 to an unknown command) are read and dropped."""
        deadline = time.monotonic() + seconds
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if self.sock.recv(65536) == b"":
                    return True
            return False
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(5)

    def close(self) -> None:
        self.sock.close()
