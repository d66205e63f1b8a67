"""The real `kvmesh` CLI on a zmq failure: a URL zmq refuses is exit 2 naming the
URL; any other zmq error (here: no file descriptor left for the socket) is exit 1 and
zmq's own words, never blamed on a URL that is fine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

KVMESH = str(Path(sys.executable).with_name("kvmesh"))
ENV = {**os.environ, "KVMESH_CONFIG": ""}

# Well-formed endpoints on which nothing listens: the CLI gets as far as opening sockets.
ADMIN = ("admin", "--url", "tcp://127.0.0.1:1", "--timeout", "1", "workers")
LOOKUP = ("admin", "--timeout", "1", "lookup", "0:10", "--lookup-url", "tcp://127.0.0.1:1")
EVENTS = ("events", "--controller", "127.0.0.1", "--events-port", "1", "--replay-port", "2")
EVENTS += ("--duration", "1")


def _run(args: tuple[str, ...], nofile: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return subprocess.run(
        [KVMESH, *args], capture_output=True, text=True, timeout=60, env=ENV, preexec_fn=limit
    )


def _starved(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    """The CLI run under the lowest descriptor limit at which Python and libzmq's own
    threads start but the zmq socket cannot be opened (EMFILE). Searched for, since the
    count Python uses at start varies; lower limits abort inside libzmq (SIGABRT)."""
    for nofile in range(8, 40):
        done = _run(args, nofile)
        if done.returncode == -6 or done.returncode == 134:
            continue
        assert "Too many open files" in done.stderr, (nofile, done.returncode, done.stderr)
        return done
    pytest.fail("no descriptor limit made libzmq fail without aborting")


@pytest.mark.parametrize("args", [ADMIN, LOOKUP, EVENTS], ids=["admin", "lookup", "events"])
def test_no_file_descriptor_left_is_a_zmq_error_not_a_bad_url(args: tuple[str, ...]) -> None:
    done = _starved(args)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "error: zmq: Too many open files"
    assert "expected tcp://" not in done.stderr and "Invalid value" not in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (("admin", "--url", "tcp://-:1", "--timeout", "1", "workers"), "--url 'tcp://-:1'"),
        (
            ("admin", "--url", "ipc://" + "x" * 200, "--timeout", "1", "workers"),
            "File name too long",
        ),
        (
            ("admin", "--timeout", "1", "lookup", "0:10", "--lookup-url", "tcp://*:7610"),
            "--lookup-url 'tcp://*:7610'",
        ),
    ],
    ids=["admin-host", "admin-ipc-path", "lookup-wildcard"],
)
def test_a_url_zmq_refuses_is_still_exit_2(args: tuple[str, ...], named: str) -> None:
    done = _run(args)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "expected tcp://host:port" in done.stderr
    assert "Traceback" not in done.stderr


def test_events_with_a_host_zmq_refuses_is_still_exit_2() -> None:
    done = _run(("events", "--controller", "-", "--events-port", "1", "--duration", "1"))
    assert done.returncode == 2, done.stderr
    assert "--controller" in done.stderr and "tcp://-:1: Invalid argument" in done.stderr
