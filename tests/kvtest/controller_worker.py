"""A worker engine in its own process, for the controller tests:

    python -m kvtest.controller_worker URL INSTANCE P2P_ENDPOINT SEED NTOKENS

registers with the controller, stores NTOKENS tokens of seed SEED, prints one JSON line
{"keys": [...]} once the controller has been sent the events, then serves until killed
(heartbeats continue on the engine's loop) or until stdin closes (clean close)."""

from __future__ import annotations

import json
import sys
import time

from kvtest.controller import build_engine, store, tokens


def main() -> None:
    url, instance, endpoint, seed, n = sys.argv[1:6]
    eng = build_engine(instance, url, p2p_endpoint=endpoint, heartbeat_s=0.2)
    keys = store(eng, tokens(int(n), int(seed)))
    time.sleep(0.1)  # past one event flush period
    print(json.dumps({"keys": keys}), flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    eng.close()


if __name__ == "__main__":
    main()
