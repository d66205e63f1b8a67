"""A worker engine with a lookup endpoint in its own process, for the lookup-server tests:

    python -m kvtest.lookup_worker URL INSTANCE LOOKUP_ENDPOINT SEED TOTAL N

registers with the controller, serves the lookup protocol at LOOKUP_ENDPOINT, stores
the first N of `tokens(TOTAL, SEED)`, and prints one JSON line {"endpoint", "keys"}
once the controller has its lookup endpoint and its events; then serves until killed
or until stdin closes (clean close). It logs as a kvmesh service does, per the
KVMESH_LOGGING__* environment."""

from __future__ import annotations

import json
import sys
import time

from kvmesh.common.config import load_config
from kvmesh.common.observability import configure_logging
from kvmesh.services.worker.lookup_server import attach_lookup_server
from kvtest.controller import build_engine, store, tokens


def main() -> None:
    url, instance, endpoint, seed, total, n = sys.argv[1:7]
    logging = load_config().logging
    configure_logging(logging.level, json=logging.json, service=f"worker-{instance}")
    eng = build_engine(instance, url, heartbeat_s=0.2)
    attach_lookup_server(eng, endpoint)
    keys = store(eng, tokens(int(total), int(seed))[: int(n)])
    client = eng.controller_client
    deadline = time.monotonic() + 20
    # The client registered before the lookup server bound: it registers again.
    while not (client.registered and client._sent_lookup_endpoint == eng.lookup_endpoint):
        if time.monotonic() > deadline:
            raise SystemExit("lookup endpoint not registered")
        time.sleep(0.02)
    time.sleep(0.1)  # past one event flush period
    print(json.dumps({"endpoint": eng.lookup_endpoint, "keys": keys}), flush=True)
    sys.stdin.read()
    eng.close()


if __name__ == "__main__":
    main()
