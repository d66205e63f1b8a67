"""One way to run a process under test: the `kvmesh serve` services (the bridge
included), redis-server, vLLM's API server and the kvtest worker processes.

A `ServiceProcess` is ready when it writes its ready file, listens on its port, answers
200 on its health URL, or prints its ready line on stdout (exactly one of these). Every
failure to get there, a death or the deadline, raises with the end of the process's log
in the message, so a broken start says why in the test report rather than in a file
left in a temp dir. It stops the way a supervisor would: asked first (SIGTERM, or EOF on
stdin for a process that takes commands there), SIGKILL after a grace period. One
launched in a session of its own (new_session) is signalled as a whole process group,
and what is left of the group once it has exited is killed: children that outlive it
(vLLM's engine) go with it.

    with ServiceProcess("echo", cmd, log=tmp / "echo.log", ready_file=tmp / "r") as p:
        ...  # started and ready here; stopped on the way out
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

TESTS = Path(__file__).resolve().parents[1]
POLL_S = 0.02
HEALTH_POLL_S = 0.25  # a request each time: not 50 a second at a server coming up
TAIL_CHARS = 2000
# Plain-text warnings and worse: the log tail in an error message is read by a person.
QUIET_LOGS = {"KVMESH_LOGGING__JSON": "false", "KVMESH_LOGGING__LEVEL": "warning"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """A process under test; `proc` is its Popen while it has been launched (tests
    signal it directly to pause or kill it), `ready_info` what it said when ready:
    the ready file's JSON, the ready line's JSON, or {} for a port or a health URL.
    ready_timeout_s is how long wait_ready and start wait when not told."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        log: Path,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        ready_file: Path | None = None,
        ready_port: int | None = None,
        ready_line: str | None = None,
        ready_url: str | None = None,
        stdin: bool = False,
        new_session: bool = False,
        ready_timeout_s: float = 20.0,
        stop_grace_s: float = 10.0,
        tail_chars: int = TAIL_CHARS,
    ) -> None:
        readies = (ready_file, ready_port, ready_line, ready_url)
        if sum(x is not None for x in readies) != 1:
            raise ValueError("give exactly one of ready_file, ready_port, ready_line, ready_url")
        self.name = name
        self.cmd = list(cmd)
        self.log = log
        self.cwd = cwd
        self.env = dict(env or {})
        self.ready_file = ready_file
        self.ready_port = ready_port
        self.ready_line = ready_line
        self.ready_url = ready_url
        self.stdin = stdin
        self.new_session = new_session
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.tail_chars = tail_chars
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_info: dict[str, Any] = {}
        self._stdout = b""

    def launch(self) -> None:
        """Start the process without waiting for it (wait_ready does), so that a test
        can start several and let them come up together."""
        if self.alive():
            raise RuntimeError(self.describe("is already running"))
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)  # a restart must not find the last one
        self._stdout = b""
        # os.environ is read now, not at construction: tests set variables just
        # before a start.
        env = {**os.environ, **self.env}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.ready_line is not None else out,
                stderr=out,
                env=env,
                cwd=self.cwd,
                start_new_session=self.new_session,
            )

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until it is ready; kill it and raise RuntimeError (it died) or
        TimeoutError (the deadline), with its log tail, if it does not get there."""
        assert self.proc is not None, "launch() first"
        timeout = self.ready_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            if self.ready_line is not None:
                info = self._await_ready_line(deadline, timeout)
            else:
                info = self._poll_ready(deadline, timeout)
        except BaseException:
            self.kill()  # never leave a half-started process behind a failed test
            raise
        self.ready_info = info
        return info

    def start(self, timeout: float | None = None) -> Self:
        self.launch()
        self.wait_ready(timeout)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self._signal(signal.SIGKILL)
            self.proc.wait(10)
        self._finish()

    def freeze(self, seconds: float) -> None:
        """SIGSTOP it for `seconds`, then SIGCONT: its connections stay open and nothing
        answers (a paused VM, a process swapped out)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, grace_s: float | None = None) -> int | None:
        """Ask it to exit, SIGKILL it after grace_s (default stop_grace_s); its exit
        code (None if it was never launched)."""
        if self.proc is not None and self.proc.poll() is None:
            if self.proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    self.proc.stdin.close()
            else:
                self._signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._finish()
        return None if self.proc is None else self.proc.returncode

    def cleanup(self) -> None:
        """What to remove once it has exited (or if it was never launched): stop and
        kill call it, maybe more than once; nothing here."""

    def send_line(self, line: str) -> None:
        """One line on its stdin (for a process launched with stdin=True)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def read_line(self, timeout: float) -> str:
        """The next line it prints on stdout (for a process launched with a
        ready_line), without the newline."""
        return self._read_line(time.monotonic() + timeout, f"printed no line in {timeout}s")

    def log_tail(self, chars: int | None = None) -> str:
        chars = self.tail_chars if chars is None else chars
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def describe(self, what: str) -> str:
        """`what` about this process, with the end of its log: the text of every
        error it raises."""
        pid = self.proc.pid if self.proc is not None else None
        return f"{self.name} (pid {pid}) {what}; the end of {self.log}:\n{self.log_tail()}"

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _poll_ready(self, deadline: float, timeout: float) -> dict[str, Any]:
        assert self.proc is not None
        poll_s = POLL_S if self.ready_url is None else HEALTH_POLL_S
        # Checked before the exit status: a process may write its ready file and exit.
        while (info := self._ready_now()) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(self.describe(f"exited ({self.proc.returncode}) before ready"))
            if time.monotonic() > deadline:
                raise TimeoutError(self.describe(f"not ready after {timeout}s"))
            time.sleep(poll_s)
        return info

    def _ready_now(self) -> dict[str, Any] | None:
        if self.ready_file is not None:
            # Written atomically (rename) by the services: it exists only when whole.
            return json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None
        if self.ready_url is not None:
            try:
                with urllib.request.urlopen(self.ready_url, timeout=1.0) as resp:
                    return {} if resp.status == 200 else None
            except (urllib.error.URLError, OSError):
                return None
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.ready_port), 0.2),
        ):
            return {}
        return None

    def _await_ready_line(self, deadline: float, timeout: float) -> dict[str, Any]:
        assert self.ready_line is not None
        late = f"printed no line starting {self.ready_line!r} in {timeout}s"
        while True:
            line = self._read_line(deadline, late)
            if line.startswith(self.ready_line):  # earlier lines are a library's chatter
                return json.loads(line)

    def _read_line(self, deadline: float, late: str) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        # os.read on the descriptor, not readline on the buffered file: select says
        # nothing of lines a buffered reader already holds.
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._stdout:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(self.describe(late))
            readable, _, _ = select.select([fd], [], [], left)
            if not readable:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                raise RuntimeError(self.describe(f"closed its stdout ({self.proc.returncode})"))
            self._stdout += chunk
        line, _, self._stdout = self._stdout.partition(b"\n")
        return line.decode(errors="replace")

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if self.new_session:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def _finish(self) -> None:
        """Once it has exited (or was never launched): the rest of its process group
        killed, its pipes closed, cleanup()."""
        if self.proc is not None:
            if self.proc.poll() is None:
                return
            if self.new_session:
                # A child may outlive the leader by a moment (vLLM's engine core).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        self.cleanup()


class KvmeshService(ServiceProcess):
    """`python -m kvmesh.services.<module>` (what `kvmesh serve <module>` runs) on
    `port`, in workdir: options become `--name value` flags (True: a bare `--name`),
    its output goes to workdir/<module>-<port>.log, and it is ready once it writes its
    ready file. The port is fixed, so a restart keeps the address clients use."""

    def __init__(
        self, module: str, workdir: Path, port: int, options: Mapping[str, object]
    ) -> None:
        self.workdir = workdir
        self.port = port
        ready = workdir / f"{module}-{port}.ready.json"
        cmd = [sys.executable, "-m", f"kvmesh.services.{module}", "--port", str(port)]
        cmd += ["--ready-file", str(ready)]
        for k, v in options.items():
            cmd += [f"--{k}"] if v is True else [f"--{k}", str(v)]
        super().__init__(
            module,
            cmd,
            log=workdir / f"{module}-{port}.log",
            cwd=workdir,
            env=QUIET_LOGS,
            ready_file=ready,
        )


class KvtestProcess(ServiceProcess):
    """`python -m kvtest.<module> ARGS` (a process these tests run their own code in,
    after `prefix`, e.g. `ip netns exec NS`): ready once it prints a JSON line starting
    with ready_line; it may take commands on stdin, and it exits cleanly when its stdin
    closes."""

    def __init__(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        log: Path,
        ready_line: str,
        prefix: Sequence[str] = (),
        stop_grace_s: float = 10.0,
    ) -> None:
        super().__init__(
            name,
            [*prefix, sys.executable, "-m", f"kvtest.{module}", *args],
            log=log,
            cwd=TESTS,
            env={**QUIET_LOGS, "PYTHONPATH": _with_tests(os.environ.get("PYTHONPATH", ""))},
            ready_line=ready_line,
            stdin=True,
            stop_grace_s=stop_grace_s,
        )

    def __call__(self, timeout: float = 30.0, **cmd: Any) -> dict:
        """One command to a process serving them (kvtest.p2p.serve_commands): its JSON
        answer, which must not be an error."""
        self.send_line(json.dumps(cmd))
        answer = json.loads(self.read_line(timeout))
        assert "error" not in answer, (cmd, answer)
        return answer


def _with_tests(pythonpath: str) -> str:
    # Prepended, not replaced: a run against another checkout sets PYTHONPATH, and
    # its worker processes must import the same kvmesh as the test.
    return os.pathsep.join(p for p in (str(TESTS), pythonpath) if p)
