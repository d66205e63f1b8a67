"""Reading a PagedKVLayout from the engine's tensors, and the no-copy views over them."""

import pytest
import torch

from kvmesh.gpu_ext.layout import (
    VLLM_LAYOUT_NAMES,
    KVKind,
    PagedKVLayout,
    build_views,
    describe_kv_caches,
)

L, B, N, H, D = 4, 5, 16, 2, 8


def vllm_cache(name: str, heads: int = H) -> torch.Tensor:
    """A logical [layers, blocks, heads, tokens, 2*head_dim] tensor stored in `name` order."""
    sizes = {"L": L, "B": B, "H": heads, "N": N, "C": 2 * D}
    physical = torch.zeros([sizes[c] for c in name], dtype=torch.bfloat16)
    return physical.permute([name.index(c) for c in "LBHNC"])


@pytest.mark.parametrize("cross", [False, True], ids=["per-layer-views", "cross-layer"])
@pytest.mark.parametrize("name", VLLM_LAYOUT_NAMES)
def test_vllm_layouts_are_named_from_strides(name: str, cross: bool) -> None:
    logical = vllm_cache(name)
    lay = describe_kv_caches(logical if cross else list(logical.unbind(0)))
    assert lay == PagedKVLayout(
        kind=KVKind.PACKED_KV,
        num_layers=L,
        num_blocks=B,
        block_size=N,
        kv_heads=H,
        head_dim=D,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        layout_name=name,
    )


def test_cpu_backend_per_layer_tensors_are_lbhnc() -> None:
    layers = [torch.zeros(B, H, N, 2 * D, dtype=torch.float16) for _ in range(L)]
    lay = describe_kv_caches(layers)
    assert (lay.kind, lay.layout_name, lay.num_layers) == (KVKind.PACKED_KV, "LBHNC", L)
    assert lay.bytes_per_token == L * 2 * H * D * 2
    assert lay.bytes_per_token_layer == 2 * H * D * 2
    assert lay.chunk_shape(256) == (2, L, 256, H * D)
    assert lay.layer_chunk_shape(256) == (2, 256, H * D)
    assert lay.chunk_nbytes(256) == 256 * lay.bytes_per_token
    assert (lay.chunk_format_name, lay.is_mla, lay.num_slots) == ("KV_2LTD", False, B * N)


def test_split_kv_and_mla() -> None:
    split = describe_kv_caches([torch.zeros(2, B, N, H, D) for _ in range(L)])
    assert (split.kind, split.kv_heads, split.head_dim, split.layout_name) == (
        KVKind.SPLIT_KV,
        H,
        D,
        None,
    )
    mla = describe_kv_caches([torch.zeros(B, N, 576, dtype=torch.float16) for _ in range(L)])
    assert (mla.kind, mla.kv_heads, mla.head_dim, mla.chunk_format_name) == (
        KVKind.MLA,
        1,
        576,
        "KV_MLA",
    )
    assert mla.chunk_shape(256) == (L, 256, 576)
    assert mla.layer_chunk_shape(256) == (256, 576)
    assert mla.bytes_per_token == L * 576 * 2
    cross = describe_kv_caches(torch.zeros(L, B, N, 576), mla=True)
    assert (cross.kind, cross.num_layers) == (KVKind.MLA, L)


def test_vllm_dict_is_ordered_by_layer_number() -> None:
    layers = [torch.zeros(B, H, N, 2 * D) for _ in range(12)]
    registered = {f"model.layers.{i}.self_attn.attn": layers[i] for i in (10, 2, 0, 11, 1)}
    registered.update({f"model.layers.{i}.self_attn.attn": layers[i] for i in range(12)})
    views = build_views(registered)
    assert [v.data_ptr() for v in views.layers] == [t.data_ptr() for t in layers]


def test_hint_resolves_what_strides_cannot() -> None:
    # One kv head: the H and N strides no longer tell LBHNC from LBNHC.
    logical = vllm_cache("LBNHC", heads=1)
    assert describe_kv_caches(logical).layout_name == "LBHNC"
    assert describe_kv_caches(logical, layout_hint="LBNHC").layout_name == "LBNHC"
    with pytest.raises(ValueError, match="does not match"):
        describe_kv_caches(vllm_cache("BLHNC"), layout_hint="LBHNC")
    with pytest.raises(ValueError, match="not one of"):
        describe_kv_caches(logical, layout_hint="NHD")


@pytest.mark.parametrize(
    ("caches", "kwargs", "match"),
    [
        ([], {}, "empty"),
        ([torch.zeros(4, 4)], {}, "cannot read"),
        ([torch.zeros(B, H, N, 7)], {}, "odd"),
        ([torch.zeros(3, B, N, H, D)], {}, "cannot read"),
        ([torch.zeros(B, H, N, 2 * D), torch.zeros(B, H, N, 4 * D)], {}, "differs"),
        ([torch.zeros(B, H, N, 2 * D), torch.zeros(B, H, N, 2 * D).half()], {}, "differs"),
        ([torch.zeros(B, H, N, 2 * D)], {"mla": True}, "MLA"),
        ([torch.zeros(B, N, 64)], {"mla": False}, "MLA is false"),
        ([torch.zeros(1, H, N, 2 * D).expand(B, H, N, 2 * D)], {}, "positive"),
        (torch.zeros(B, N, 64), {}, "too small"),
        ("not tensors", {}, "torch.Tensor"),
    ],
)
def test_uninterpretable_caches_raise(caches, kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        describe_kv_caches(caches, **kwargs)


@pytest.mark.parametrize("name", VLLM_LAYOUT_NAMES)
def test_views_alias_the_engine_memory(name: str) -> None:
    logical = vllm_cache(name)
    views = build_views(logical)
    # Canonical [blocks, block_size, kv, heads, head_dim]: V of head 1, token 3 of block 2.
    views.layers[1][2, 3, 1, 1, 5] = 42.0
    assert logical[1, 2, 1, 3, D + 5] == 42.0
    rows = views.rows[1]
    assert rows.untyped_storage().data_ptr() == logical.untyped_storage().data_ptr()
    index = views.row_index(torch.tensor([2 * N + 3]))  # [kv, rows_per_token]: K/V rows
    assert views.rows_per_token == H and views.row_len == D
    assert rows[index[1, 1], 5] == 42.0
    assert int(rows.ne(0).sum()) == 1
