"""How kvmesh's logging shares a process's stderr: with library threads writing at the
same moment, and inside a host's process (vLLM's), whose logging is the host's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

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


SIGNALLED = textwrap.dedent(
    """
    import logging, signal
    from kvmesh.common.observability import configure_logging, get_logger

    configure_logging("info", json=True, service="t")
    ours = get_logger("ours")

    def on_alarm(*_):
        logging.getLogger("sig").warning("alarm")
        ours.warning("alarm too")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    for _ in range(200):
        ours.info("ours", pad="x" * 20_000)
    """
)


def test_a_signal_handler_that_logs_inside_a_write_does_not_hang() -> None:
    """The alarm comes while the process is blocked writing to a full pipe: a plain
    lock around the writes made its handler's line wait on its own thread, forever."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        time.sleep(1.0)  # not read yet: the pipe is full when the alarm comes
        err = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert b'"alarm"' in err and b'"alarm too"' in err


FORKED = textwrap.dedent(
    """
    import logging, os, threading, time
    from kvmesh.common.observability import configure_logging, get_logger

    configure_logging("info", json=True, service="t")
    lib, ours = logging.getLogger("lib"), get_logger("ours")
    stop = False

    def chatter():
        while not stop:
            lib.info("x" * 4000)
            ours.info("y" * 4000)

    threading.Thread(target=chatter, daemon=True).start()
    for _ in range(20):
        time.sleep(0.01)
        pid = os.fork()
        if pid == 0:
            lib.warning("from the child")
            ours.warning("ours from the child")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    stop = True
    """
)


def test_a_forked_child_logs_though_a_thread_held_the_lock_at_the_fork() -> None:
    """The lock is remade in the child: one held at the fork by a thread the child does
    not have would never be let go (20 of 20 children hung in a review's run)."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED], capture_output=True, timeout=60, check=True
    )
    assert done.stderr.count(b'"from the child"') == 20
    assert done.stderr.count(b'"ours from the child"') == 20
