"""A mesh engine (kvtest.mesh_node) that also serves the lookup protocol, for the
lookup-server fault tests:

    python -m kvtest.lookup_mesh_node CONFIG.json

Same config and commands as mesh_node, plus "lookup_endpoint" (bound at start and
registered with the controller before the ready line), "pin_timeout_s", and the
commands "pins" (lookups whose pins this engine holds) and "clear" (seeds' prompts
removed from every tier, so that a lookup must no longer count them).
"""

from __future__ import annotations

import time
from typing import Any

from kvmesh.services.worker.lookup_server import attach_lookup_server
from kvtest.mesh_node import MeshNode, prompt_tokens
from kvtest.p2p import serve_commands


class LookupMeshNode(MeshNode):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        e = self.engine
        # Short pin expiry, so a test sees pins of lookups nobody released go away
        # within its run (the config default is 30 s).
        e.pins._timeout_s = cfg.get("pin_timeout_s", 2.0)
        attach_lookup_server(e, cfg["lookup_endpoint"])
        client = e.controller_client
        deadline = time.monotonic() + 20
        # The client registered before the lookup server bound: it registers again.
        while not (client.registered and client._sent_lookup_endpoint == e.lookup_endpoint):
            if time.monotonic() > deadline:
                raise SystemExit("lookup endpoint not registered")
            time.sleep(0.02)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        e = self.engine
        if op == "info":
            return {**super().handle(cmd), "lookup_endpoint": e.lookup_endpoint}
        if op == "pins":
            return {"pins": len(e.pins)}
        if op == "clear":
            e.storage.flush(5.0)  # a put still in flight would store it again
            removed = [e.clear(prompt_tokens(s)) for s in cmd["seeds"]]
            return {"removed": removed}
        return super().handle(cmd)


def main() -> None:
    serve_commands(LookupMeshNode)


if __name__ == "__main__":
    main()
