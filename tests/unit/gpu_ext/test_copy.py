"""Paged KV ⇄ chunk copies: exact round trips for every layout, dtype and mode.

Data is random bit patterns (NaNs and -0.0 included), so every comparison is on the
bits: a copy that went through float arithmetic would show.
"""

import os

# The Triton interpreter must be chosen before triton is imported; this module is the
# only one in the suite that uses triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvmesh.gpu_ext import KVCopier, make_copier, native_copy, torch_ops
from kvmesh.gpu_ext.layout import VLLM_LAYOUT_NAMES, KVKind
from kvmesh.gpu_ext.triton_ops import unavailable_reason

L, B, N, H, D = 3, 7, 4, 2, 8  # layers, blocks, block_size, kv heads, head_dim
NUM_SLOTS = B * N
TOKENS = 13  # not a multiple of the block size
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
    return t.view(BITS[t.element_size()])


def random_fill(t: torch.Tensor) -> None:
    info = torch.iinfo(BITS[t.element_size()])
    bits(t).copy_(torch.randint(info.min, info.max, t.shape, dtype=BITS[t.element_size()]))


def make_cache(spec: str, dtype: torch.dtype, random: bool, head_dim: int = D):
    """(what the engine registers, per-layer logical tensors, kind) for a layout spec."""
    name, _, form = spec.partition("-")
    if name in VLLM_LAYOUT_NAMES:
        sizes = {"L": L, "B": B, "H": H, "N": N, "C": 2 * head_dim}
        physical = torch.zeros([sizes[c] for c in name], dtype=dtype)
        logical = physical.permute([name.index(c) for c in "LBHNC"])
        layers = list(logical.unbind(0))
        engine_view = logical if form == "cross" else layers
        kind = KVKind.PACKED_KV
    elif name in ("cpu", "dict"):
        layers = [torch.zeros(B, H, N, 2 * head_dim, dtype=dtype) for _ in range(L)]
        engine_view = layers
        if name == "dict":  # vLLM's registered dict, inserted out of layer order
            engine_view = {f"model.layers.{i}.self_attn.attn": layers[i] for i in (2, 0, 1)}
        kind = KVKind.PACKED_KV
    elif name in ("split", "mla"):
        shape = (2, B, N, H, head_dim) if name == "split" else (B, N, 4 * head_dim)
        if form == "cross":
            engine_view = torch.zeros(L, *shape, dtype=dtype)
            layers = list(engine_view.unbind(0))
        else:
            layers = [torch.zeros(shape, dtype=dtype) for _ in range(L)]
            engine_view = layers
        kind = KVKind.SPLIT_KV if name == "split" else KVKind.MLA
    else:
        raise AssertionError(spec)
    if random:
        for t in layers:
            random_fill(t)
    return engine_view, layers, kind


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


def as_chunk(tokens: torch.Tensor, kind: KVKind) -> torch.Tensor:
    """[layers, n, kv, hidden] token data in the chunk's own layout."""
    return tokens[:, :, 0] if kind is KVKind.MLA else tokens.permute(2, 0, 1, 3)


def gather(copier: KVCopier, slots: torch.Tensor, mode: str) -> torch.Tensor:
    lay = copier.layout
    chunk = torch.full(lay.chunk_shape(len(slots)), 7, dtype=lay.dtype)
    if mode == "all":
        copier.gather(slots, chunk)
    for layer in range(lay.num_layers if mode != "all" else 0):
        if mode == "layer":
            buf = torch.empty(lay.layer_chunk_shape(len(slots)), dtype=lay.dtype)
            copier.gather(slots, buf, layer=layer)
            chunk[..., layer, :, :] = buf
        else:  # the engine's way: the whole chunk, one layer at a time
            copier.gather(slots, chunk, layer=layer)
    return chunk


def scatter(copier: KVCopier, slots: torch.Tensor, chunk: torch.Tensor, mode: str) -> None:
    if mode == "all":
        copier.scatter(slots, chunk)
        return
    for layer in range(copier.layout.num_layers):
        buf = chunk[..., layer, :, :] if mode == "layer" else chunk
        copier.scatter(slots, buf.contiguous() if mode == "layer" else buf, layer=layer)


@pytest.mark.parametrize("mode", ["all", "layer", "layer-in-chunk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_is_exact(spec: str, dtype: torch.dtype, mode: str) -> None:
    engine_view, layers, kind = make_cache(spec, dtype, random=True)
    copier = make_copier(engine_view, backend="torch")
    assert copier.layout.kind is kind
    source = slot_tokens(layers, kind)
    slots = torch.randperm(NUM_SLOTS)[:TOKENS]

    chunk = gather(copier, slots, mode)
    assert torch.equal(bits(chunk), bits(as_chunk(source[:, slots], kind)))

    fresh_view, fresh_layers, _ = make_cache(spec, dtype, random=False)
    fresh = make_copier(fresh_view, backend="torch")
    other = torch.randperm(NUM_SLOTS)[:TOKENS]
    scatter(fresh, other, chunk, mode)
    assert torch.equal(bits(gather(fresh, other, mode)), bits(chunk))

    # The written slots hold the original tokens; every other slot is still zero.
    written = slot_tokens(fresh_layers, kind)
    assert torch.equal(bits(written[:, other]), bits(source[:, slots]))
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[other] = False
    assert not bits(written[:, untouched]).any()


@pytest.mark.parametrize("spec", ["LBHNC-layers", "BHLNC-cross", "split", "mla"])
def test_token_range_within_chunk(spec: str) -> None:
    engine_view, layers, kind = make_cache(spec, torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    slots = torch.randperm(NUM_SLOTS)[:TOKENS]
    chunk = torch.zeros(copier.layout.chunk_shape(20), dtype=torch.float16)
    copier.gather(slots, chunk, start=5, end=5 + TOKENS)
    expect = torch.zeros_like(chunk)
    expect[..., 5 : 5 + TOKENS, :] = as_chunk(slot_tokens(layers, kind)[:, slots], kind)
    assert torch.equal(bits(chunk), bits(expect))

    fresh_view, fresh_layers, _ = make_cache(spec, torch.float16, random=False)
    make_copier(fresh_view, backend="torch").scatter(slots[:4], chunk, start=5)
    written = slot_tokens(fresh_layers, kind)[:, slots[:4]]
    assert torch.equal(bits(as_chunk(written, kind)), bits(expect[..., 5:9, :]))


def test_odd_head_dim_cannot_widen_but_still_copies() -> None:
    engine_view, layers, kind = make_cache("LBNHC-cross", torch.float16, True, head_dim=3)
    slots = torch.randperm(NUM_SLOTS)[:TOKENS]
    chunk = gather(make_copier(engine_view, backend="torch"), slots, "all")
    fresh_view, fresh_layers, _ = make_cache("LBNHC-cross", torch.float16, False, head_dim=3)
    make_copier(fresh_view, backend="torch").scatter(slots, chunk)
    written, source = slot_tokens(fresh_layers, kind), slot_tokens(layers, kind)
    assert torch.equal(bits(written[:, slots]), bits(source[:, slots]))
    assert bits(written).ne(0).sum() == bits(source[:, slots]).ne(0).sum()


@pytest.mark.parametrize("bad", [[0, NUM_SLOTS], [-1, 3]])
def test_out_of_range_slots_are_rejected(bad: list[int]) -> None:
    engine_view, _, _ = make_cache("LHBNC-cross", torch.float16, random=False)
    copier = make_copier(engine_view, backend="torch")
    chunk = torch.zeros(copier.layout.chunk_shape(2), dtype=torch.float16)
    with pytest.raises(ValueError, match="outside"):
        copier.gather(torch.tensor(bad), chunk)
    with pytest.raises(ValueError, match="outside"):
        copier.scatter(torch.tensor(bad), chunk)
    assert not chunk.any()


def test_bad_buffers_are_rejected() -> None:
    engine_view, _, _ = make_cache("cpu", torch.float16, random=False)
    copier = make_copier(engine_view, backend="torch")
    slots = torch.tensor([1, 2, 3])
    lay = copier.layout
    with pytest.raises(ValueError, match="shape"):
        copier.gather(slots, torch.zeros(lay.chunk_shape(2), dtype=torch.float16))
    with pytest.raises(ValueError, match="float32"):
        copier.gather(slots, torch.zeros(lay.chunk_shape(3), dtype=torch.float32))
    with pytest.raises(ValueError, match="layer 3"):
        copier.gather(slots, torch.zeros(lay.chunk_shape(3), dtype=torch.float16), layer=3)
    with pytest.raises(ValueError, match="token range"):
        copier.gather(slots, torch.zeros(lay.chunk_shape(3), dtype=torch.float16), end=2)
    with pytest.raises(ValueError, match="contiguous"):
        copier.gather(slots, torch.zeros(2, 3, L, H * D, dtype=torch.float16).transpose(1, 2))
    with pytest.raises(ValueError, match="backend"):
        make_copier(engine_view, backend="cuda")  # type: ignore[arg-type]


def test_auto_backend_is_torch_on_cpu() -> None:
    engine_view, _, _ = make_cache("cpu", torch.float16, random=False)
    assert make_copier(engine_view).backend == "torch"


# -- Triton kernels, in the interpreter: they must move the same bytes as torch ----------


def require_triton() -> None:
    # Fails rather than skips: a machine without triton must say so (ARCHITECTURE §6).
    reason = unavailable_reason(torch.device("cpu"))
    assert reason is None, f"Triton kernels cannot run here: {reason}"


TRITON_CASES = [(spec, torch.float16, "all") for spec in SPECS] + [
    ("LBHNC-layers", torch.bfloat16, "all"),
    ("BLNHC-cross", torch.float32, "all"),
    ("BHLNC-cross", torch.float16, "layer"),
    ("cpu", torch.bfloat16, "layer-in-chunk"),
    ("split", torch.float32, "layer"),
    ("mla", torch.bfloat16, "layer"),
]


@pytest.mark.parametrize(("spec", "dtype", "mode"), TRITON_CASES, ids=str)
def test_triton_matches_torch(spec: str, dtype: torch.dtype, mode: str) -> None:
    require_triton()
    engine_view, _, kind = make_cache(spec, dtype, random=True)
    by_torch = make_copier(engine_view, backend="torch")
    by_triton = make_copier(engine_view, backend="triton")
    assert by_triton.backend == "triton"
    slots = torch.randperm(NUM_SLOTS)[:TOKENS]
    chunk = gather(by_torch, slots, mode)
    assert torch.equal(bits(gather(by_triton, slots, mode)), bits(chunk))

    other = torch.randperm(NUM_SLOTS)[:TOKENS]
    results = []
    for backend in ("torch", "triton"):
        fresh_view, fresh_layers, _ = make_cache(spec, dtype, random=False)
        scatter(make_copier(fresh_view, backend=backend), other, chunk, mode)
        results.append(bits(slot_tokens(fresh_layers, kind)))
    assert torch.equal(results[0], results[1])


def test_triton_token_range_and_padding_slots() -> None:
    require_triton()
    engine_view, layers, kind = make_cache("LBNHC-layers", torch.float16, random=True)
    copier = make_copier(engine_view, backend="triton")
    slots = torch.tensor([5, -1, 17, 2])  # vLLM pads with -1: skipped, never checked on host
    chunk = torch.zeros(copier.layout.chunk_shape(8), dtype=torch.float16)
    copier.gather(slots, chunk, start=3)
    tokens = as_chunk(slot_tokens(layers, kind), kind)
    for i, slot in enumerate(slots.tolist()):
        want = tokens[..., slot, :] if slot >= 0 else torch.zeros_like(tokens[..., 0, :])
        assert torch.equal(bits(chunk[..., 3 + i, :]), bits(want))

    fresh_view, fresh_layers, _ = make_cache("LBNHC-layers", torch.float16, random=False)
    make_copier(fresh_view, backend="triton").scatter(slots, chunk, start=3)
    written = slot_tokens(fresh_layers, kind)
    assert torch.equal(bits(written[:, [5, 17, 2]]), bits(slot_tokens(layers, kind)[:, [5, 17, 2]]))
    assert int(bits(written).ne(0).sum()) == int(bits(written[:, [5, 17, 2]]).ne(0).sum())


# -- whole-block slot mappings: the torch path moves blocks instead of rows --------------


def whole_block_slots(blocks: torch.Tensor, tail: int = 0) -> torch.Tensor:
    """vLLM's mapping: each block's slots in order, then the first `tail` slots of one more."""
    full = (blocks[:-1].view(-1, 1) * N + torch.arange(N)).view(-1)
    return torch.cat([full, blocks[-1] * N + torch.arange(tail)])


def gather_by_rows(copier: KVCopier, slots: torch.Tensor, mode: str) -> torch.Tensor:
    """What the row path gathers, whatever the mapping."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_ops, "whole_blocks", lambda views, slots: None)
        mp.setattr(native_copy, "_block_copy", None)
        return gather(copier, slots, mode)


@pytest.mark.parametrize("tail", [0, 3], ids=["whole", "tail"])
@pytest.mark.parametrize("mode", ["all", "layer", "layer-in-chunk"])
@pytest.mark.parametrize("spec", SPECS)
def test_whole_block_gather_matches_rows_bit_for_bit(spec: str, mode: str, tail: int) -> None:
    engine_view, layers, kind = make_cache(spec, torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    slots = whole_block_slots(torch.randperm(B)[:6], tail)
    assert torch.equal(torch_ops.whole_blocks(copier.views, slots), slots[: 5 * N : N] // N)

    chunk = gather(copier, slots, mode)
    assert torch.equal(bits(chunk), bits(as_chunk(slot_tokens(layers, kind)[:, slots], kind)))
    assert torch.equal(bits(chunk), bits(gather_by_rows(copier, slots, mode)))

    fresh_view, fresh_layers, _ = make_cache(spec, torch.float16, random=False)
    scatter(make_copier(fresh_view, backend="torch"), slots, chunk, mode)
    written = slot_tokens(fresh_layers, kind)
    assert torch.equal(bits(written[:, slots]), bits(slot_tokens(layers, kind)[:, slots]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ["cpu", "BLNHC-cross", "split", "mla-cross"])
def test_whole_block_gather_every_dtype_and_token_range(spec: str, dtype: torch.dtype) -> None:
    engine_view, layers, kind = make_cache(spec, dtype, random=True)
    copier = make_copier(engine_view, backend="torch")
    slots = whole_block_slots(torch.randperm(B)[:4], 2)  # 3 whole blocks, then 2 tokens
    chunk = torch.zeros(copier.layout.chunk_shape(20), dtype=dtype)
    copier.gather(slots, chunk, start=4, end=4 + len(slots))
    expect = torch.zeros_like(chunk)
    expect[..., 4 : 4 + len(slots), :] = as_chunk(slot_tokens(layers, kind)[:, slots], kind)
    assert torch.equal(bits(chunk), bits(expect))


@pytest.mark.parametrize(
    "slots",
    [
        [N + 1, N + 2, N + 3, 2 * N],  # a run that starts inside a block
        [N + 3, N + 2, N + 1, N],  # one block, backwards
        [0, 1, 2, 4],  # a block's first slots, then the next block's
        [2 * N, 2 * N + 1, 2 * N + 2, 2 * N + 2],  # a slot twice (gather reads it twice)
        [N, N + 1, N + 2],  # shorter than a block
    ],
    ids=["offset", "backwards", "gap", "repeat", "short"],
)
def test_mappings_that_are_not_whole_blocks_go_by_rows(slots: list[int]) -> None:
    engine_view, layers, kind = make_cache("cpu", torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    index = torch.tensor(slots)
    assert torch_ops.whole_blocks(copier.views, index) is None
    chunk = gather(copier, index, "all")
    assert torch.equal(bits(chunk), bits(as_chunk(slot_tokens(layers, kind)[:, index], kind)))


def test_block_size_one_is_always_whole_blocks() -> None:
    layers = [torch.zeros(B * N, H, 1, 2 * D, dtype=torch.float16) for _ in range(L)]
    for t in layers:
        random_fill(t)
    copier = make_copier(layers, backend="torch")
    slots = torch.randperm(B * N)[:TOKENS]
    assert torch_ops.whole_blocks(copier.views, slots) is slots
    chunk = gather(copier, slots, "all")
    want = [t[slots, :, 0].unflatten(-1, (2, D)).permute(2, 0, 1, 3) for t in layers]
    assert torch.equal(bits(chunk), bits(torch.stack(want, 1).flatten(-2)))


@pytest.mark.parametrize("spec", ["cpu", "LHBNC-cross", "mla"])
def test_unaligned_buffers_copy_at_a_narrower_width(spec: str) -> None:
    # A buffer one element into its storage cannot be viewed as int64 (or complex128)
    # like the cache: both sides fall back to a width the buffer allows.
    engine_view, layers, kind = make_cache(spec, torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    assert copier.views.wide_layers[0].element_size() == 8
    assert copier.views.wide_rows[0].element_size() == 16
    shape = copier.layout.chunk_shape(TOKENS + 1)
    storage = torch.zeros(1 + torch.Size(shape).numel(), dtype=torch.float16)
    chunk = storage[1:].view(shape)
    slots = whole_block_slots(torch.randperm(B)[:4], 1)
    copier.gather(slots, chunk, end=len(slots))
    source = slot_tokens(layers, kind)
    assert torch.equal(bits(chunk[..., : len(slots), :]), bits(as_chunk(source[:, slots], kind)))

    fresh_view, fresh_layers, _ = make_cache(spec, torch.float16, random=False)
    make_copier(fresh_view, backend="torch").scatter(slots, chunk)
    assert torch.equal(bits(slot_tokens(fresh_layers, kind)[:, slots]), bits(source[:, slots]))


def test_out_of_range_whole_blocks_are_rejected_before_any_copy() -> None:
    engine_view, _, _ = make_cache("cpu", torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    slots = whole_block_slots(torch.tensor([1, B, 0]))  # block B does not exist
    chunk = torch.zeros(copier.layout.chunk_shape(len(slots)), dtype=torch.float16)
    with pytest.raises(ValueError, match="outside"):
        copier.gather(slots, chunk)
    assert not chunk.any()


# -- the C helper (gpu_ext/csrc/block_copy.c) against the torch-only paths ---------------


def test_native_helper_is_built() -> None:
    # `make install` builds it; without it the CPU copier is ~2x slower on retrieve.
    assert native_copy.available()


def torch_only(fn, *args):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_copy, "_block_copy", None)
        return fn(*args)


@pytest.mark.parametrize("big", [False, True], ids=["small", "streamed-threaded"])
@pytest.mark.parametrize("mode", ["all", "layer", "layer-in-chunk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_native_matches_torch_bit_for_bit(
    spec: str, dtype: torch.dtype, mode: str, big: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if big:  # every size takes the threaded, non-temporal path
        monkeypatch.setattr(native_copy, "PARALLEL_BYTES", 0)
        monkeypatch.setattr(native_copy, "STREAM_BYTES", 0)
    # head_dim 32: runs of 64 bytes or more, which the streaming stores take.
    engine_view, layers, kind = make_cache(spec, dtype, random=True, head_dim=32)
    copier = make_copier(engine_view, backend="torch")
    # Two whole blocks, a run starting inside a block, one more whole block, a tail.
    blocks = torch.randperm(B)[:5]
    slots = torch.cat(
        [
            whole_block_slots(blocks[:3], 0),
            blocks[2] * N + torch.arange(1, N),
            whole_block_slots(blocks[3:], 2),
        ]
    )
    chunk = gather(copier, slots, mode)
    assert torch.equal(bits(chunk), bits(torch_only(gather, copier, slots, mode)))
    assert torch.equal(bits(chunk), bits(as_chunk(slot_tokens(layers, kind)[:, slots], kind)))

    # Scatter into distinct slots (the mapping above repeats one block's slots), on
    # two caches with the same random contents: what is not written must stay as it was.
    target = whole_block_slots(torch.randperm(B)[:6], 3)[: len(slots)]
    written = []
    for run in (scatter, lambda *a: torch_only(scatter, *a)):
        torch.manual_seed(5)
        view, fresh_layers, _ = make_cache(spec, dtype, random=True, head_dim=32)
        run(make_copier(view, backend="torch"), target, chunk, mode)
        written.append(slot_tokens(fresh_layers, kind))
    assert torch.equal(bits(written[0]), bits(written[1]))
    assert torch.equal(bits(written[0][:, target]), bits(as_chunk_inverse(chunk, kind)))


def as_chunk_inverse(chunk: torch.Tensor, kind: KVKind) -> torch.Tensor:
    """[layers, n, kv, hidden] from a chunk in its own layout (the inverse of as_chunk)."""
    return chunk.unsqueeze(2) if kind is KVKind.MLA else chunk.permute(1, 2, 0, 3)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_native_rejects_out_of_range_slots_before_any_copy(direction: str) -> None:
    engine_view, layers, kind = make_cache("cpu", torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    before = slot_tokens(layers, kind).clone()
    slots = whole_block_slots(torch.tensor([1, 0, B]), 1)  # the last block does not exist
    chunk = torch.zeros(copier.layout.chunk_shape(len(slots)), dtype=torch.float16)
    with pytest.raises(ValueError, match="outside"):
        getattr(copier, direction)(slots, chunk)
    assert not chunk.any()
    assert torch.equal(bits(slot_tokens(layers, kind)), bits(before))


# -- gather_chunks / scatter_chunks: a request's chunks in one call ----------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize("spec", SPECS)
def test_chunk_batches_equal_one_call_per_chunk(spec: str, native: bool) -> None:
    engine_view, layers, kind = make_cache(spec, torch.float16, random=True, head_dim=32)
    copier = make_copier(engine_view, backend="torch")
    # A request of 3 chunks: 2 whole blocks, 1 block + a run inside another, 2 tokens.
    slots = torch.cat(
        [whole_block_slots(torch.randperm(B - 1)[:4], 0), torch.tensor([N * 6 + 1, N * 6 + 2])]
    )
    spans = [(0, 2 * N), (2 * N, 3 * N + 1), (3 * N + 1, len(slots))]
    outs = [torch.zeros(copier.layout.chunk_shape(e - s), dtype=torch.float16) for s, e in spans]
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(native_copy, "_block_copy", None)
        copier.gather_chunks(slots, spans, outs)
    source = slot_tokens(layers, kind)
    for (s, e), out in zip(spans, outs, strict=True):
        assert torch.equal(bits(out), bits(as_chunk(source[:, slots[s:e]], kind)))

    target = torch.randperm(NUM_SLOTS)[: len(slots)]
    written = []
    for batched in (True, False):
        torch.manual_seed(9)
        view, fresh_layers, _ = make_cache(spec, torch.float16, random=True, head_dim=32)
        fresh = make_copier(view, backend="torch")
        with pytest.MonkeyPatch.context() as mp:
            if not native:
                mp.setattr(native_copy, "_block_copy", None)
            if batched:
                fresh.scatter_chunks(target, spans, outs)
            else:
                for (s, e), out in zip(spans, outs, strict=True):
                    fresh.scatter(target[s:e], out)
        written.append(slot_tokens(fresh_layers, kind))
    assert torch.equal(bits(written[0]), bits(written[1]))
    assert torch.equal(bits(written[0][:, target]), bits(source[:, slots]))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize(
    "bad", ["slot", "shape", "dtype"], ids=["slot-out-of-range", "wrong-shape", "wrong-dtype"]
)
def test_chunk_batch_failure_says_how_many_chunks_are_done(native: bool, bad: str) -> None:
    engine_view, layers, kind = make_cache("cpu", torch.float16, random=True)
    copier = make_copier(engine_view, backend="torch")
    slots = whole_block_slots(torch.randperm(B)[:5], 0)  # 4 whole blocks
    spans = [(0, N), (N, 2 * N), (2 * N, 3 * N), (3 * N, 4 * N)]
    outs = [torch.zeros(copier.layout.chunk_shape(N), dtype=torch.float16) for _ in spans]
    if bad == "slot":
        slots[2 * N : 3 * N] += NUM_SLOTS  # the third chunk names slots past the cache
    elif bad == "shape":
        outs[2] = torch.zeros(copier.layout.chunk_shape(N - 1), dtype=torch.float16)
    else:
        outs[2] = torch.zeros(copier.layout.chunk_shape(N), dtype=torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(native_copy, "_block_copy", None)
        with pytest.raises(ValueError) as info:
            copier.gather_chunks(slots, spans, outs)
    assert info.value.chunks_done == 2
    source = slot_tokens(layers, kind)
    for (s, e), out in zip(spans[:2], outs[:2], strict=True):
        assert torch.equal(bits(out), bits(as_chunk(source[:, slots[s:e]], kind)))
    assert not outs[3].any()


@pytest.mark.parametrize("buffers", ["whole-chunk", "layer-buffer"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize("spec", ["cpu", "BHLNC-cross", "split", "mla"])
def test_chunk_batches_one_layer_at_a_time(spec: str, native: bool, buffers: str) -> None:
    engine_view, layers, kind = make_cache(spec, torch.float16, random=True, head_dim=32)
    copier = make_copier(engine_view, backend="torch")
    lay = copier.layout
    slots = torch.cat(
        [whole_block_slots(torch.randperm(B - 1)[:3], 0), torch.tensor([N * 6 + 1, N * 6 + 2])]
    )
    spans = [(0, N), (N, 2 * N + 1), (2 * N + 1, len(slots))]
    target = torch.randperm(NUM_SLOTS)[: len(slots)]
    torch.manual_seed(3)
    fresh_view, fresh_layers, _ = make_cache(spec, torch.float16, random=True, head_dim=32)
    fresh = make_copier(fresh_view, backend="torch")
    before = slot_tokens(fresh_layers, kind).clone()
    source = slot_tokens(layers, kind)
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(native_copy, "_block_copy", None)
        for layer in range(L):
            if buffers == "whole-chunk":
                outs = [torch.zeros(lay.chunk_shape(e - s), dtype=torch.float16) for s, e in spans]
            else:
                outs = [
                    torch.zeros(lay.layer_chunk_shape(e - s), dtype=torch.float16) for s, e in spans
                ]
            copier.gather_chunks(slots, spans, outs, layer=layer)
            for (s, e), out in zip(spans, outs, strict=True):
                want = as_chunk(source[layer : layer + 1, slots[s:e]], kind)
                got = out[..., layer : layer + 1, :, :] if buffers == "whole-chunk" else out
                if buffers == "layer-buffer":
                    want = want.squeeze(-3)
                assert torch.equal(bits(got), bits(want))
                if buffers == "whole-chunk":  # other layers untouched
                    rest = torch.cat([out[..., :layer, :, :], out[..., layer + 1 :, :, :]], -3)
                    assert not rest.any()
            fresh.scatter_chunks(target, spans, outs, layer=layer)
    written = slot_tokens(fresh_layers, kind)
    assert torch.equal(bits(written[:, target]), bits(source[:, slots]))
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[target] = False
    assert torch.equal(bits(written[:, untouched]), bits(before[:, untouched]))
