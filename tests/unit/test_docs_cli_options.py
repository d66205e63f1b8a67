"""Every `kvmesh ...` command the user docs show parses: its subcommands exist and each
`--option` belongs to the command it follows (click reads options level by level, so
`kvmesh admin workers --json` fails while `kvmesh admin --json workers` works).

Commands are taken from fenced console/shell blocks (lines starting `$ kvmesh` or
`# kvmesh`, with `\\` continuations) and from inline code spans starting `kvmesh `.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from kvmesh.services.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "README.md",
    "docs/configuration.md",
    "docs/deployment.md",
    "docs/operations.md",
    "docs/troubleshooting.md",
    "k8s/kvmesh/README.md",
    "k8s/kvmesh/templates/NOTES.txt",
    "compose.yaml",
    "docker/compose/curve.yaml",
]
# Where a command line ends inside a shell line or a sentence.
_END = {"|", "||", "&&", ";", ">", ">>", "2>&1", "#"}


def _commands(text: str) -> list[tuple[int, str]]:
    """(line number, command text) of every `kvmesh` invocation in text."""
    found: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        start = i + 1
        m = re.match(r"^\s*(?:[$#]\s+)?(?:\.venv/bin/)?(kvmesh\s.*)$", line)
        if m:
            cmd = m.group(1)
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            found.append((start, cmd))
        else:
            found += [(start, c) for c in re.findall(r"`(kvmesh [^`]+)`", line)]
        i += 1
    return found


def _check(cmd: str) -> str | None:
    """Why `cmd` would not parse, or None. Prose ("kvmesh process") is not a command."""
    try:
        words = shlex.split(cmd, comments=False)
    except ValueError:
        words = cmd.split()
    command: click.Command = cli
    path = ["kvmesh"]
    for word in words[1:]:
        if word in _END or word.startswith(("#", "`")):
            break
        word = word.strip("[]")  # usage lines: [--instance I]
        if isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
            path.append(word)
            continue
        if len(path) == 1:
            return None  # "kvmesh serves ...": not an invocation
        if word.startswith("--"):
            name = word.split("=", 1)[0]
            ctx = click.Context(command, info_name=path[-1])
            known = {o for p in command.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}
            if name not in known:
                return f"`{' '.join(path)}` has no option {name}"
    return None


CASES = [(doc, line, cmd) for doc in DOCS for line, cmd in _commands((ROOT / doc).read_text())]


def test_docs_show_kvmesh_commands() -> None:
    # The extraction finds the commands (a regex gone wrong would pass everything).
    assert len(CASES) > 50
    assert any(cmd.startswith("kvmesh admin --json workers") for _, _, cmd in CASES)


@pytest.mark.parametrize(("doc", "line", "cmd"), CASES, ids=[f"{d}:{n}" for d, n, _ in CASES])
def test_documented_command_parses(doc: str, line: int, cmd: str) -> None:
    problem = _check(cmd)
    assert problem is None, f"{doc}, line {line}: {cmd}\n{problem}"
