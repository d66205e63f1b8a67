"""`kvmesh demo --engine-only`: store real KV through the engine and load it back, bit
for bit, without vLLM.

The paged cache has vLLM's CPU layout (one [blocks, kv_heads, block_size, 2*head_dim]
tensor per layer). The demo fills it with random KV for a prompt, stores the prompt's
chunks into L1 (the host memory pool, under their chunk keys), then loads them into a
fresh cache at other slots and compares.
"""

from __future__ import annotations

import time

import click
import torch

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine


def _paged_cache(layers: int, blocks: int, heads: int, block: int, head_dim: int) -> list:
    return [
        torch.zeros(blocks, heads, block, 2 * head_dim, dtype=torch.float16) for _ in range(layers)
    ]


def _slots(num_tokens: int, blocks: int, block: int, gen: torch.Generator) -> torch.Tensor:
    order = torch.randperm(blocks, generator=gen)[: -(-num_tokens // block)]
    return (order[:, None] * block + torch.arange(block)).flatten()[:num_tokens]


def engine_round_trip(tokens: int, layers: int, seed: int) -> None:
    """Store a prompt's KV in kvmesh, load it into a fresh cache, verify it."""
    heads, head_dim, block = 4, 64, 16
    blocks = -(-tokens // block) + 8
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 32000, (tokens,), generator=gen).tolist()
    config = EngineConfig(model_name="demo", l1=L1Config(max_size=256 << 20, reserve=0))

    source = _paged_cache(layers, blocks, heads, block, head_dim)
    for layer in source:
        layer.copy_(torch.randn(layer.shape, generator=gen, dtype=torch.float32))
    src_slots = _slots(tokens, blocks, block, gen)

    engine = KVEngine("demo", 0, config, source)
    try:
        per_token = engine.layout.bytes_per_token
        click.echo(
            f"paged KV: {layers} layers × [{blocks} blocks, {heads} heads, {block} tokens, "
            f"{2 * head_dim}] fp16 = {per_token} B/token; chunks of {config.chunk_size} tokens"
        )
        t0 = time.perf_counter()
        stored = engine.store(prompt, src_slots)
        t_store = time.perf_counter() - t0
        click.echo(
            f"store:    {stored} of {tokens} tokens ({stored // config.chunk_size} full chunks) "
            f"in {t_store * 1e3:.1f} ms; L1 holds {engine.pool.used_bytes / 2**20:.1f} MiB"
        )
        first_key = next(iter(engine.chunks(prompt)))[2]
        click.echo(f"first chunk key: {first_key.to_str()}")

        hit = engine.lookup(prompt, lookup_id="demo-1")
        click.echo(f"lookup:   {hit} tokens cached (pinned until retrieve)")

        target = _paged_cache(layers, blocks, heads, block, head_dim)
        engine.register_kv_caches(target)
        dst_slots = _slots(tokens, blocks, block, gen)
        t0 = time.perf_counter()
        loaded = engine.retrieve(prompt, dst_slots, lookup_id="demo-1")
        t_load = time.perf_counter() - t0
        n = int(loaded.sum())
        ok = all(
            torch.equal(_rows(s, src_slots[:n], block), _rows(t, dst_slots[:n], block))
            for s, t in zip(source, target, strict=True)
        )
        click.echo(
            f"retrieve: {n} tokens into other slots of a fresh cache in {t_load * 1e3:.1f} ms"
        )
        click.echo(f"verify:   {'bitwise equal' if ok else 'MISMATCH'} over {layers} layers")
        if not ok or n != stored:
            raise click.ClickException("the loaded KV differs from what was stored")
    finally:
        engine.close()


def _rows(layer: torch.Tensor, slots: torch.Tensor, block: int) -> torch.Tensor:
    # [blocks, heads, block, dim] → the [tokens, heads, dim] rows of the given slots.
    return layer[slots // block, :, slots % block]
