"""`kvmesh serve controller`'s KV-event feed flags: a real controller started with
them serves the feed and its replay socket on those ports; a replay port without the
feed is refused before anything binds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from click.testing import CliRunner
from kvtest.service_process import KvmeshService, free_port

from kvmesh.common.transport.kv_events_client import KvEventsSubscriber
from kvmesh.services.cli.main import cli


def test_events_flags_open_the_feed_and_its_replay_socket(tmp_path: Path) -> None:
    events, replay = free_port(), free_port()
    options = {"http-port": 0, "events-port": events, "events-replay-port": replay}
    with KvmeshService("controller", tmp_path, free_port(), options) as ctl:
        info = ctl.ready_info
        assert (info["events_port"], info["events_replay_port"]) == (events, replay)

        async def ask() -> tuple[str, int]:
            sub = KvEventsSubscriber(
                f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}", replay_timeout_s=10
            )
            async with sub:
                entries, epoch, last_seq = await sub.replay(0)
            assert entries == []
            return epoch, last_seq

        epoch, last_seq = asyncio.run(ask())
        assert epoch and last_seq == 0


def test_without_events_flags_the_feed_is_off(tmp_path: Path) -> None:
    with KvmeshService("controller", tmp_path, free_port(), {"http-port": 0}) as ctl:
        info = ctl.ready_info
        assert (info["events_port"], info["events_replay_port"]) == (0, 0)


def test_replay_port_without_the_feed_is_refused() -> None:
    res = CliRunner().invoke(
        cli,
        ["serve", "controller", "--port", "0", "--events-replay-port", str(free_port())],
        env={"KVMESH_CONFIG": ""},
    )
    assert res.exit_code == 2, res.output
    assert "events_replay_port" in res.output and "needs events_port" in res.output
