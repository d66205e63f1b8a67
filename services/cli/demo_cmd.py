"""`kvmesh demo`: a real vLLM on CPU reuses a long prompt's KV through kvmesh.

Builds the demo model locally when missing (random weights, a locally trained
tokenizer: nothing is downloaded), starts vLLM with the kvmesh connector, sends the
same long prompt twice and prints the time to first token of each and how many
tokens the second took from kvmesh. `--engine-only` runs the engine round trip
without vLLM (demo_engine.py).
"""

from __future__ import annotations

import sys
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import click

from kvmesh.common.config import ConfigError, load_config


@click.command()
@click.option(
    "--tokens", type=click.IntRange(min=1), default=3000, show_default=True, help="Prompt length."
)
@click.option(
    "--model",
    "model_kind",
    type=click.Choice(["demo", "tiny"]),
    default="demo",
    show_default=True,
    help="demo: 8 layers, hidden 512 (prefill dominates); tiny: 2 layers, hidden 128.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="kvmesh YAML config for the connector (default: an L1 of 512MiB). Local "
    "services it names (a kvmesh:// cache-server on loopback) are started.",
)
@click.option(
    "--fresh-process",
    is_flag=True,
    help="Serve the second request in a new vLLM process: hits then come from tiers "
    "that outlive a process (disk, remote), as named by --config.",
)
@click.option("-v", "--verbose", is_flag=True, help="Print vLLM's log instead of a progress line.")
@click.option("--engine-only", is_flag=True, help="Engine round trip without vLLM.")
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="--engine-only: layers.",
)
@click.option("--seed", default=0, show_default=True, help="Prompt seed.")
def demo(
    tokens: int,
    model_kind: str,
    config_path: str | None,
    fresh_process: bool,
    verbose: bool,
    engine_only: bool,
    layers: int,
    seed: int,
) -> None:
    """Serve a long prompt twice in vLLM through kvmesh; print cold and warm TTFT."""
    if engine_only:
        from kvmesh.common.config import EngineConfig
        from kvmesh.services.cli.demo_engine import engine_round_trip

        # Only full chunks are stored: a shorter prompt has nothing to store or load.
        chunk = EngineConfig().chunk_size
        if tokens < chunk:
            raise click.BadParameter(
                f"at least {chunk} (one chunk) with --engine-only", param_hint="--tokens"
            )

        engine_round_trip(tokens, layers, seed)
        return
    try:
        cfg = load_config(config_path) if config_path else None
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    # Imported here: vLLM and transformers take seconds to import.
    from kvmesh.services.cli.local_services import ServiceStartError, local_services
    from kvmesh.services.worker.vllm.testing import SessionError, connector_config
    from kvmesh.services.worker.vllm.tiny_model import (
        PREFILL_BOUND,
        TinyModelSpec,
        build_tiny_model,
        default_models_dir,
        prompt_tokens,
    )

    spec = PREFILL_BOUND if model_kind == "demo" else TinyModelSpec()
    max_len = tokens + 16
    if max_len > spec.max_position_embeddings:
        raise click.BadParameter(
            f"at most {spec.max_position_embeddings - 16} for the {model_kind} model",
            param_hint="--tokens",
        )
    target = default_models_dir() / spec.name
    if not target.exists():
        click.echo(f"model:    building {spec.name} under {target.parent} (once)")
    model = build_tiny_model(spec)
    click.echo(
        f"model:    {model.name}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_kv_heads} KV heads × {spec.head_dim}, {spec.dtype}"
    )
    instance = f"demo-{uuid.uuid4().hex[:8]}"
    if config_path:
        connector: dict[str, Any] = {"config_path": str(Path(config_path).resolve())}
    else:
        connector = connector_config(l1_size="512MiB")
    connector["instance_id"] = instance
    prompt = prompt_tokens(tokens, seed=seed, vocab_size=spec.vocab_size)
    try:
        with local_services(cfg, config_path) if cfg else nullcontext([]) as started:
            for line in started:
                click.echo(f"services: {line}")
            cold, warm = _serve(model, prompt, connector, fresh_process, max_len, verbose)
    except (SessionError, ServiceStartError) as exc:
        raise click.ClickException(str(exc)) from exc
    _report(tokens, cold, warm, fresh_process)


def _serve(
    model: Path,
    prompt: list[int],
    connector: dict[str, Any],
    fresh: bool,
    max_len: int,
    verbose: bool,
) -> tuple[Any, Any]:
    from kvmesh.services.worker.vllm.testing import Step, run_session

    kwargs = {"connector": connector, "max_model_len": max_len}
    if not fresh:
        with _Progress("vLLM", verbose) as progress:
            result = run_session(model, [Step(prompt), Step(prompt)], progress=progress, **kwargs)
        click.echo(f"vLLM:     started in {result.startup_s:.1f} s with the kvmesh connector")
        _counters("vLLM", result, verbose)
        return result.steps[0], result.steps[1]
    with _Progress("vLLM process A", verbose) as progress:
        a = run_session(model, [Step(prompt)], progress=progress, **kwargs)
    click.echo(f"vLLM A:   started in {a.startup_s:.1f} s, served the prompt, exited")
    _counters("vLLM A", a, verbose)
    kwargs["connector"] = {**connector, "instance_id": f"{connector['instance_id']}-b"}
    with _Progress("vLLM process B", verbose) as progress:
        b = run_session(model, [Step(prompt)], progress=progress, **kwargs)
    click.echo(f"vLLM B:   a fresh process, started in {b.startup_s:.1f} s")
    _counters("vLLM B", b, verbose)
    return a.steps[0], b.steps[0]


def _counters(label: str, result: Any, verbose: bool) -> None:
    if verbose:
        counters = ", ".join(f"{k}={v:g}" for k, v in result.engine.items() if v)
        click.echo(f"{label} kvmesh counters: {counters}")


def _report(tokens: int, cold: Any, warm: Any, fresh: bool) -> None:
    saved = (cold.kvmesh or {}).get("saved_tokens", 0)
    click.echo(
        f"cold:     TTFT {cold.seconds * 1e3:8.1f} ms  {tokens}-token prompt computed; "
        f"{saved} tokens stored in kvmesh"
    )
    click.echo(
        f"warm:     TTFT {warm.seconds * 1e3:8.1f} ms  {warm.hit_tokens} of {tokens} tokens "
        f"loaded from kvmesh, {tokens - warm.hit_tokens} computed"
    )
    same = warm.output_tokens == cold.output_tokens
    diff = max(
        (abs(lp - warm.logprobs[0].get(t, float("inf"))) for t, lp in cold.logprobs[0].items()),
        default=0.0,
    )
    click.echo(
        f"result:   {cold.seconds / warm.seconds:.1f}× faster to the first token; "
        f"same first token: {'yes' if same else 'NO'} (largest top-5 logprob difference {diff:.2g})"
    )
    if not same:
        raise click.ClickException("the warm request answered differently from the cold one")
    if warm.hit_tokens == 0:
        hint = (
            "a fresh process finds only what a disk or remote tier kept: name one in --config"
            if fresh
            else "the second request found nothing in kvmesh"
        )
        raise click.ClickException(hint)


class _Progress:
    """One status line while vLLM starts (elapsed time and its latest log line), or its
    whole log with --verbose."""

    def __init__(self, label: str, verbose: bool) -> None:
        self.label, self.verbose, self.bar = label, verbose, None

    def __enter__(self) -> _Progress:
        if not self.verbose:
            from tqdm import tqdm

            self.bar = tqdm(
                desc=f"{self.label} starting",
                bar_format="{desc} {elapsed} {postfix}",
                file=sys.stderr,
                leave=False,
            )
        return self

    def __call__(self, line: str) -> None:
        if self.bar is None:
            click.echo(line, err=True)
            return
        text = line.strip()
        if text:
            self.bar.set_postfix_str(text[-70:], refresh=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
