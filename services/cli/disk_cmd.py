"""`kvmesh disk ...`: inspect a disk tier's directory without starting anything."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import click
from tqdm import tqdm

from kvmesh.common.config import format_size, parse_size
from kvmesh.services.worker.tiers.disk_scan import (
    LOCK_FILE,
    Listing,
    ScannedFile,
    check_files,
    list_dir,
    plan_eviction,
)

_NS_DIR = re.compile(r"[0-9a-f]{16}")


@dataclass
class DirReport:
    path: str
    in_use_by: str | None = None
    error: str | None = None  # the directory could not be read: nothing else is known
    keep: list[ScannedFile] = field(default_factory=list)
    drop: list[tuple[str, int, str]] = field(default_factory=list)  # (file, bytes, why)
    ignored: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "in_use_by": self.in_use_by,
            "error": self.error,
            "keep": {"files": len(self.keep), "bytes": sum(f.size for f in self.keep)},
            "drop": [{"file": n, "bytes": b, "reason": r} for n, b, r in self.drop],
            "ignored": self.ignored,
        }


def tier_dirs(root: str) -> list[str]:
    """The tier directories under root: root itself when it holds chunk files (or a
    tier's lock), else its namespace-id subdirectories (an `engine.disk.path`)."""
    names = os.listdir(root)
    if LOCK_FILE in names or any(n.endswith((".kv", ".tmp")) for n in names):
        return [root]
    subdirs = sorted(
        os.path.join(root, n)
        for n in names
        if _NS_DIR.fullmatch(n) and os.path.isdir(os.path.join(root, n))
    )
    return subdirs or [root]


def lock_holder(path: str) -> str | None:
    """Who holds the directory's lock (a running tier), or None. Read from /proc/locks
    rather than by trying the lock, so a scan can never make a starting tier find its
    directory busy."""
    try:
        st = os.stat(os.path.join(path, LOCK_FILE))
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 fd:00:1234 0 EOF" (a "->" marks a waiter)
        if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
            continue
        try:
            major, minor, inode = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                return f"pid {parts[4]}"
        except ValueError:
            continue
    return None


@click.group("disk")
def disk() -> None:
    """Inspect disk tier (L3) directories."""


@disk.command("scan")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option(
    "--max-size",
    default=None,
    help="The tier's engine.disk.max_size (e.g. 50GiB): also show what a start would "
    "evict to fit it.",
)
@click.option(
    "--policy",
    type=click.Choice(["lru", "lfu", "fifo", "mru"]),
    default="lru",
    show_default=True,
    help="The tier's eviction policy (which files go first when over --max-size).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Also read every payload and check its checksum. A start reads headers only "
    "(each read verifies its payload), so this reads far more.",
)
@click.option(
    "--max-chunk",
    default=None,
    help="The largest chunk the tier's engine can read (its L1 page: `page_bytes` in its "
    "'engine started' log line, e.g. 4MiB): files whose header claims more are dropped, "
    "as the tier's re-index drops them.",
)
@click.option("--list", "list_files", is_flag=True, help="Print every file that would be dropped.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@click.option(
    "--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr."
)
def scan(
    directory: str,
    max_size: str | None,
    max_chunk: str | None,
    policy: str,
    verify: bool,
    list_files: bool,
    as_json: bool,
    progress: bool,
) -> None:
    """Show what a disk tier starting on DIRECTORY would keep and drop. Changes nothing.

    DIRECTORY is an `engine.disk.path` (each namespace subdirectory is one engine's
    tier) or one tier's directory. A start deletes temporary files (writes a crash
    interrupted) and chunk files whose header, key or size is wrong, evicts the oldest
    files beyond the maximum size, and leaves every other file alone.
    """
    try:
        limit = parse_size(max_size) if max_size is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-size") from None
    try:
        chunk_limit = parse_size(max_chunk) if max_chunk is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-chunk") from None
    if chunk_limit is not None and chunk_limit <= 0:
        raise click.BadParameter("must be > 0", param_hint="--max-chunk")
    try:
        dirs = tier_dirs(directory)
    except OSError as exc:
        raise click.ClickException(f"{directory}: cannot read: {exc.strerror}") from None
    listings: list[tuple[str, Listing]] = []
    reports: list[DirReport] = []
    for d in dirs:
        try:
            listings.append((d, list_dir(d)))
        except OSError as exc:
            # One unreadable namespace directory must not hide the others' reports.
            reports.append(DirReport(d, error=f"cannot read: {exc.strerror}"))
    total = sum(len(listing.chunks) for _, listing in listings)
    with tqdm(total=total, unit="file", desc="scanning", disable=not progress, leave=False) as bar:
        for path, listing in listings:
            report = DirReport(path, in_use_by=lock_holder(path), ignored=list(listing.ignored))
            report.drop.extend(
                (n, _size(path, n), "temporary file (an interrupted write)") for n in listing.temps
            )
            for f in check_files(
                path, listing.chunks, verify_payload=verify, max_nbytes=chunk_limit
            ):
                bar.update(1)
                if f.ok:
                    report.keep.append(f)
                else:
                    report.drop.append((f.name, f.size, f.problem or "invalid"))
            if limit is not None:
                report.keep, evicted = plan_eviction(report.keep, limit, policy)
                report.drop.extend(
                    (f.name, f.size, f"evicted to fit max size {format_size(limit)}")
                    for f in evicted
                )
            reports.append(report)
    reports.sort(key=lambda r: dirs.index(r.path))
    failed = [r for r in reports if r.error is not None]
    if as_json:
        click.echo(json.dumps({"directories": [r.as_dict() for r in reports]}, indent=2))
    else:
        for r in reports:
            _print_report(r, list_files)
    if failed:
        for r in failed:
            click.echo(f"error: {r.path}: {r.error}", err=True)
        sys.exit(1)


def _size(path: str, name: str) -> int:
    try:
        return os.lstat(os.path.join(path, name)).st_size  # a link itself, as unlinked
    except OSError:
        return 0


def _shown(name: str) -> str:
    """A file name as printed: escaped when it holds a newline or a control sequence,
    which would split a line of the report or reach the terminal."""
    return name if name.isprintable() else ascii(name)


def _print_report(r: DirReport, list_files: bool) -> None:
    if r.error is not None:
        click.echo(f"{r.path}  ({r.error})")
        return
    click.echo(r.path + (f"  (in use by a running tier, {r.in_use_by})" if r.in_use_by else ""))
    kept = sum(f.size for f in r.keep)
    dropped = sum(b for _, b, _ in r.drop)
    click.echo(f"  keep    {len(r.keep):>8} chunk files  {_human(kept):>10}")
    click.echo(f"  drop    {len(r.drop):>8} files        {_human(dropped):>10}")
    reasons = Counter(_reason_group(why) for _, _, why in r.drop)
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        click.echo(f"          {n:>8}  {why}")
    if r.ignored:
        click.echo(f"  ignore  {len(r.ignored):>8} other files (not the tier's; left alone)")
    if list_files:
        for name, size, why in r.drop:
            click.echo(f"  drop {_shown(name)}  {_human(size)}  {why}")


def _human(n: int) -> str:
    """A rounded size for people (format_size is exact, so often a byte count)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _reason_group(why: str) -> str:
    # "bad header: header checksum mismatch" and "size 10 != header + payload 20" vary
    # per file; group by their kind.
    if why.startswith("bad header"):
        return "bad header"
    if why.startswith("size "):
        return "wrong size (truncated or extended)"
    if why.startswith("holds another key"):
        return "holds another key (a misplaced or renamed file)"
    if why.startswith("header says"):
        return "claims a chunk larger than --max-chunk"
    if why.startswith("unreadable"):
        return why  # one errno each: few groups
    if "did not decode" in why:
        return "payload did not decode"
    if why.startswith(("payload", "stored payload")):
        return "payload does not match its header (length or checksum)"
    return why
