"""Paged KV caches in every layout the engine supports, and readers of their slots."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from kvmesh.gpu_ext.layout import VLLM_LAYOUT_NAMES, KVKind

# Every layout spec: vLLM's six stride orders as per-layer views or one cross-layer
# tensor, the CPU backend's per-layer tensors (as a list and as vLLM's name → tensor
# dict), the older split K/V layout and MLA.
SPECS = [f"{name}-{form}" for name in VLLM_LAYOUT_NAMES for form in ("layers", "cross")] + [
    "cpu",
    "dict",
    "split",
    "split-cross",
    "mla",
    "mla-cross",
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BITS = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so NaNs and -0.0 compare exactly."""
    return t.view(BITS[t.element_size()])


def random_fill(t: torch.Tensor, gen: torch.Generator | None = None) -> None:
    dt = BITS[t.element_size()]
    info = torch.iinfo(dt)
    bits(t).copy_(torch.randint(info.min, info.max, t.shape, dtype=dt, generator=gen))


def make_cache(
    spec: str,
    dtype: torch.dtype,
    random: bool,
    *,
    layers: int = 3,
    blocks: int = 7,
    block_size: int = 4,
    heads: int = 2,
    head_dim: int = 8,
):
    """(what the engine registers, per-layer logical tensors, kind) for a layout spec."""
    L, B, N, H, D = layers, blocks, block_size, heads, head_dim
    name, _, form = spec.partition("-")
    if name in VLLM_LAYOUT_NAMES:
        sizes = {"L": L, "B": B, "H": H, "N": N, "C": 2 * D}
        physical = torch.zeros([sizes[c] for c in name], dtype=dtype)
        logical = physical.permute([name.index(c) for c in "LBHNC"])
        per_layer = list(logical.unbind(0))
        engine_view = logical if form == "cross" else per_layer
        kind = KVKind.PACKED_KV
    elif name in ("cpu", "dict"):
        per_layer = [torch.zeros(B, H, N, 2 * D, dtype=dtype) for _ in range(L)]
        engine_view = per_layer
        if name == "dict":  # vLLM's registered dict, inserted out of layer order
            order = list(range(L))[::-1]
            engine_view = {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in order}
        kind = KVKind.PACKED_KV
    elif name in ("split", "mla"):
        shape = (2, B, N, H, D) if name == "split" else (B, N, 4 * D)
        if form == "cross":
            engine_view = torch.zeros(L, *shape, dtype=dtype)
            per_layer = list(engine_view.unbind(0))
        else:
            per_layer = [torch.zeros(shape, dtype=dtype) for _ in range(L)]
            engine_view = per_layer
        kind = KVKind.SPLIT_KV if name == "split" else KVKind.MLA
    else:
        raise AssertionError(spec)
    if random:
        for t in per_layer:
            random_fill(t)
    return engine_view, per_layer, kind


def slot_tokens(layers: list[torch.Tensor], kind: KVKind) -> torch.Tensor:
    """[layers, slots, kv, hidden]: each slot's data, read with plain indexing."""
    out = []
    for t in layers:
        if kind is KVKind.PACKED_KV:
            blocks, heads, tokens, packed = t.shape
            per = t.permute(0, 2, 1, 3).reshape(blocks * tokens, heads, 2, packed // 2)
            out.append(per.permute(0, 2, 1, 3).reshape(blocks * tokens, 2, -1))
        elif kind is KVKind.SPLIT_KV:
            out.append(t.permute(1, 2, 0, 3, 4).reshape(t.shape[1] * t.shape[2], 2, -1))
        else:
            out.append(t.reshape(t.shape[0] * t.shape[1], 1, t.shape[2]))
    return torch.stack(out)


def drain(gen: Generator) -> Any:
    """Step a layer-by-layer generator (a store or retrieve) to its end; its return value."""
    return drain_counting(gen)[0]


def drain_counting(gen: Generator) -> tuple[Any, int]:
    """As drain, with how many times the generator yielded (one step a layer)."""
    steps = 0
    try:
        while True:
            next(gen)
            steps += 1
    except StopIteration as stop:
        return stop.value, steps
