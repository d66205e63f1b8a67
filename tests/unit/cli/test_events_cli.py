"""`kvmesh events` without a controller: how items print, and options refused before
anything connects."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.kv_events_client import Delivery, Lost
from kvmesh.services.cli.events_cmd import as_dict
from kvmesh.services.cli.main import cli

NS = "0123456789abcdef"
KEY = f"{NS}-{'0' * 32}"


def test_json_lines_of_messages_and_losses() -> None:
    batch = kv.EventBatch("ep", 3, "I/0", "I", 1.25, [kv.KVEvent("removed", KEY, "disk")])
    line = json.loads(json.dumps(as_dict(Delivery(4, NS, batch, replayed=True))))
    assert line == {
        "seq": 4,
        "namespace": NS,
        "replayed": True,
        "kind": "events",
        "epoch": "ep",
        "prev_seq": 3,
        "worker_id": "I/0",
        "instance_id": "I",
        "ts": 1.25,
        "events": [{"op": "removed", "key": KEY, "tier": "disk"}],
    }
    left = as_dict(Delivery(5, NS, kv.WorkerLeft("ep", 4, "I/0", "I", 2.0, "dropped")))
    assert (left["kind"], left["reason"], "events" in left) == ("left", "dropped", False)
    lost = json.loads(json.dumps(as_dict(Lost("too old", "ep", (NS,), 2, 9))))
    assert lost == {
        "kind": "lost",
        "reason": "too old",
        "epoch": "ep",
        "topics": [NS],
        "after_seq": 2,
        "before_seq": 9,
    }


def test_bad_options_are_refused_with_exit_2() -> None:
    runner = CliRunner()
    base = ["events", "--events-port", "1"]
    for args, words in [
        (["--namespace", "not-hex"], "16 lower-case hex"),
        (["--since", "-1"], "must be >= 0"),
        (["--controller", "tcp://host:7650"], "host only"),
    ]:
        res = runner.invoke(cli, base + args, env={"KVMESH_CONFIG": ""})
        assert res.exit_code == 2, res.output
        assert words in res.output
    res = runner.invoke(cli, ["events"], env={"KVMESH_CONFIG": ""})
    assert res.exit_code == 2 and "no events port" in res.output
