"""How kvmesh's logging shares a process's stderr: with library threads writing at the
same moment, and inside a host's process (vLLM's), whose logging is the host's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

INTERLEAVE = textwrap.dedent(
    """
    import logging, threading
    from kvmesh.common.observability import configure_logging, get_logger

    configure_logging("info", json=True, service="t")
    ours, lib = get_logger("ours"), logging.getLogger("somelib")
    big = "x" * 20_000

    def write_ours():
        for i in range(3000):
            ours.info("ours", i=i, big=big)

    def write_lib():
        for i in range(3000):
            lib.warning("lib %d", i)

    threads = [threading.Thread(target=write_ours), threading.Thread(target=write_lib)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    """
)


def test_lines_of_two_threads_never_share_a_line() -> None:
    """structlog's print() wrote a line's text and its newline apart, and a library's
    line logged from another thread landed between them: two JSON objects on one line
    (172 of 33,000 in a review's run), which no JSON reader takes."""
    done = subprocess.run(
        [sys.executable, "-c", INTERLEAVE], capture_output=True, timeout=120, check=True
    )
    lines = done.stderr.splitlines()
    assert len(lines) == 6000
    events = [json.loads(line)["event"] for line in lines]
    assert events.count("ours") == 3000


HOSTED = textwrap.dedent(
    """
    import logging, sys
    from kvmesh.common.observability import configure_logging, get_logger

    # As the vLLM connector does: vLLM configures only its own `vllm` logger, so the
    # root logger is still bare here.
    configure_logging("info", json=True, service="kvmesh-vllm", libraries=False)
    logging.basicConfig(level=logging.WARNING, format="APP %(name)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("myapp").warning("the host's line")
    logging.getLogger("urllib3").info("below the host's level")
    get_logger("ours").info("ours")
    """
)


def test_in_a_host_process_the_root_logger_stays_the_hosts() -> None:
    """The connector took the root logger over: the host's later basicConfig was
    ignored, and its own lines (and other libraries') came out as kvmesh JSON."""
    done = subprocess.run(
        [sys.executable, "-c", HOSTED], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert "APP myapp the host's line" in lines, lines
    assert not any("below the host's level" in line for line in lines), lines
    ours = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(o["event"], o["service"]) for o in ours] == [("ours", "kvmesh-vllm")]
