"""Time to first token in a real vLLM on CPU: cold, warm from each kvmesh tier, and the
connector's overhead on a full miss.

    python -m benchmarks.ttft [--tokens 4096,8192] [--rounds 2] [--tiers l1,disk,remote] [--json]

The model is tiny_model.PREFILL_BOUND (8 layers, hidden 512, 8 heads, 4 KV heads of 64,
float32: 16 KiB of KV per token), big enough that prefill dominates a request on CPU.
Each request generates one token, so its wall time is its TTFT. vLLM runs with
`enforce_eager=True` and its own prefix cache off; each session is a fresh process that
first serves an unrelated prompt of the longest length (first passes are slow).

Sessions, for each prompt length N and round r (a distinct prompt per (N, r)):
- plain: vLLM without the connector serves the prompt: the baseline.
- l1: vLLM with the connector (L1 only) serves it twice: the first request is a full
  miss (lookup, compute, save), the second loads every full chunk from L1.
- disk / remote: a process with the connector and that tier serves other prompts
  (stores them), exits; a fresh process with only that tier (and an empty L1) serves
  them again and loads from the tier. remote is a kvmesh cache-server on loopback,
  started by the benchmark.
The figure per row is the lowest of the rounds (the least disturbed by other load).
Goals: warm from L1 >= 3x faster than cold without the connector, at every length;
the connector adds < 3% to a full miss. That is judged on the engine's own clocks (its
lookups and stores during the L1 session, per request in proportion to tokens, over
plain vLLM's TTFT): the end-to-end difference between the two processes is printed
too, but it moves by ±10% from run to run on this machine. Disk and remote rows are
reported as ratios with no goal yet. Exit status 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import tempfile
import time
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kvmesh.common.config import load_config
from kvmesh.services.cli.local_services import local_services
from kvmesh.services.worker.vllm.testing import Step, connector_config, run_session
from kvmesh.services.worker.vllm.tiny_model import PREFILL_BOUND, build_tiny_model, prompt_tokens

WARM_GOAL = 3.0  # cold / warm-from-L1
OVERHEAD_GOAL = 0.03  # (cold with connector) / (plain) - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(lengths: list[int], rounds: int, salt: int) -> dict[tuple[int, int], list[int]]:
    vocab = PREFILL_BOUND.vocab_size
    return {
        (n, r): prompt_tokens(n, seed=salt * 1000 + n + r, vocab_size=vocab)
        for n in lengths
        for r in range(rounds)
    }


def _session(label: str, model: Path, steps: list[Step], connector: Any, max_len: int) -> Any:
    t = time.perf_counter()
    print(f"  {label}: {len(steps)} requests ...", end="", flush=True, file=sys.stderr)
    result = run_session(model, steps, connector=connector, max_model_len=max_len, timeout_s=1800)
    print(f" {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return result


def _tier_rows(
    tier: str, model: Path, lengths: list[int], rounds: int, max_len: int, work: Path
) -> dict[int, dict[str, float]]:
    """Store prompts in process A with the tier, load them in a fresh process B."""
    prompts = _prompts(lengths, rounds, salt={"disk": 2, "remote": 3}[tier])
    keys = list(prompts)
    if tier == "disk":
        engine = {"disk": {"enabled": True, "path": str(work / "disk"), "max_size": "4GiB"}}
        cfg_path = None
    else:
        url = f"kvmesh://127.0.0.1:{_free_port()}"
        engine = {"remote": {"enabled": True, "url": url, "timeout_s": 5.0}}
        cfg_path = work / "remote.yaml"
        cfg_path.write_text(
            "cacheserver:\n  max_memory: 4GiB\n"
            f"engine:\n  remote:\n    enabled: true\n    url: {url}\n"
        )

    steps = [Step(prompts[k]) for k in keys]
    cfg = load_config(cfg_path) if cfg_path else None
    with local_services(cfg, str(cfg_path)) if cfg else nullcontext([]):
        a = _session(f"{tier} A", model, steps, connector_config(l1_size="1GiB", **engine), max_len)
        b = _session(f"{tier} B", model, steps, connector_config(l1_size="1GiB", **engine), max_len)
    rows: dict[int, dict[str, float]] = {}
    for i, (n, _) in enumerate(keys):
        row = rows.setdefault(n, {"seconds": float("inf"), "hit_tokens": 0})
        hit = b.steps[i].hit_tokens
        if b.steps[i].seconds < row["seconds"]:
            row.update(seconds=b.steps[i].seconds, hit_tokens=hit)
        row["stored_s"] = min(row.get("stored_s", float("inf")), a.steps[i].seconds)
    return rows


def run(lengths: list[int], rounds: int, tiers: list[str]) -> dict[str, Any]:
    model = build_tiny_model(PREFILL_BOUND)
    max_len = max(lengths) + 16
    prompts = _prompts(lengths, rounds, salt=1)
    keys = list(prompts)
    plain = _session("plain vLLM", model, [Step(prompts[k]) for k in keys], None, max_len)
    steps = [s for k in keys for s in (Step(prompts[k]), Step(prompts[k]))]
    conn = connector_config(l1_size="1GiB", instance_id=f"bench-{uuid.uuid4().hex[:8]}")
    l1 = _session("connector, L1", model, steps, conn, max_len)

    rows: dict[int, dict[str, Any]] = {}
    for i, (n, _) in enumerate(keys):
        row = rows.setdefault(
            n, {"plain_s": float("inf"), "miss_s": float("inf"), "l1_s": float("inf")}
        )
        row["plain_s"] = min(row["plain_s"], plain.steps[i].seconds)
        row["miss_s"] = min(row["miss_s"], l1.steps[2 * i].seconds)
        warm = l1.steps[2 * i + 1]
        if warm.seconds < row["l1_s"]:
            row["l1_s"], row["l1_hit_tokens"] = warm.seconds, warm.hit_tokens
    with tempfile.TemporaryDirectory(prefix="kvmesh-ttft-") as tmp:
        for tier in tiers:
            if tier == "l1":
                continue
            for n, tr in _tier_rows(tier, model, lengths, rounds, max_len, Path(tmp)).items():
                rows[n][f"{tier}_s"] = tr["seconds"]
                rows[n][f"{tier}_hit_tokens"] = tr["hit_tokens"]
    # What the connector adds to a miss, from the engine's own clocks: its lookups and
    # stores over the L1 session (stores happen on the misses; lookups are ~µs), shared
    # out per request in proportion to its tokens. Two separate vLLM processes differ by
    # ±10% from run to run here, far more than the figure sought.
    engine_s = l1.engine.get("store_seconds", 0.0) + l1.engine.get("lookup_seconds", 0.0)
    all_tokens = sum(n for n, _ in keys)
    for n, row in rows.items():
        row["engine_miss_s"] = engine_s * n / all_tokens
        row["overhead"] = row["engine_miss_s"] / row["plain_s"]
        row["e2e_overhead"] = row["miss_s"] / row["plain_s"] - 1
        for tier in tiers:
            row[f"{tier}_speedup"] = row["plain_s"] / row[f"{tier}_s"]
    return {
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "model": {
            "name": model.name,
            **{
                k: getattr(PREFILL_BOUND, k)
                for k in ("num_layers", "hidden_size", "num_kv_heads", "head_dim")
            },
        },
        "rounds": rounds,
        "rows": {str(n): r for n, r in rows.items()},
        "startup_s": {"plain": plain.startup_s, "l1": l1.startup_s},
    }


def report(result: dict[str, Any], tiers: list[str]) -> bool:
    ok = True
    print(
        f"TTFT, {result['model']['name']} ({result['model']['num_layers']} layers, hidden "
        f"{result['model']['hidden_size']}), best of {result['rounds']} rounds"
    )
    head = f"{'tokens':>7} {'plain ms':>9} {'miss ms':>9} {'e2e':>7} {'kvmesh ms':>9}"
    for tier in tiers:
        head += f" {tier + ' ms':>9} {tier + ' hits':>9} {'×':>6}"
    print(head)
    for n, row in result["rows"].items():
        line = (
            f"{n:>7} {row['plain_s'] * 1e3:9.1f} {row['miss_s'] * 1e3:9.1f}"
            f" {row['e2e_overhead']:+7.1%} {row['engine_miss_s'] * 1e3:9.1f}"
        )
        for tier in tiers:
            line += (
                f" {row[tier + '_s'] * 1e3:9.1f} {row[tier + '_hit_tokens']:9d}"
                f" {row[tier + '_speedup']:6.1f}"
            )
        print(line)
        if "l1" in tiers:
            warm_ok = row["l1_speedup"] >= WARM_GOAL
            ok &= warm_ok
            print(
                f"        warm from L1 {row['l1_speedup']:.1f}× faster than cold (goal ≥ "
                f"{WARM_GOAL:.0f}×): {'PASS' if warm_ok else 'MISS'}"
            )
        over_ok = row["overhead"] < OVERHEAD_GOAL
        ok &= over_ok
        print(
            f"        connector on a full miss: kvmesh's lookups and stores "
            f"{row['engine_miss_s'] * 1e3:.1f} ms = {row['overhead']:.1%} of plain vLLM's "
            f"TTFT (goal < {OVERHEAD_GOAL:.0%}): {'PASS' if over_ok else 'MISS'}; end to end "
            f"{row['e2e_overhead']:+.1%} (two processes: noise of ±10%)"
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ttft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokens", default="4096,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiers", default="l1,disk,remote", help="warm rows: l1, disk, remote")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.tokens.split(",")]
    tiers = [t for t in args.tiers.split(",") if t]
    if "l1" not in tiers:
        tiers.insert(0, "l1")
    unknown = set(tiers) - {"l1", "disk", "remote"}
    if unknown:
        parser.error(f"unknown tiers: {', '.join(sorted(unknown))}")
    if max(lengths) + 16 > PREFILL_BOUND.max_position_embeddings:
        parser.error(f"prompts up to {PREFILL_BOUND.max_position_embeddings - 16} tokens")
    result = run(lengths, args.rounds, tiers)
    if args.json:
        print(json.dumps(result, indent=1))
        ok = all(
            r["l1_speedup"] >= WARM_GOAL and r["overhead"] < OVERHEAD_GOAL
            for r in result["rows"].values()
        )
    else:
        ok = report(result, tiers)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
