"""The lossy cachegen codec on real KV: the tiny local model through vLLM on CPU.

Process A (the writer) serves a fixed prompt set with kvmesh storing every chunk twice:
to the disk tier through cachegen with its default settings, and raw to an `fs://`
remote (which never compresses), so the test can compare the two copies of each chunk.
A computes everything itself, so its outputs are plain vLLM's. A fresh process B loads
the prompts' chunks from the cachegen disk tier only and answers them.

Asserted: B's greedy completions equal A's on every prompt, every chunk came from the
disk, and each layer's decoded K and V keep a cosine similarity > 0.995 with the
original. Reported (printed; recorded in docs/benchmarks.md): the compression ratio,
the largest absolute error, the per-layer cosine similarity, and the change of the
first generated token's logprobs between A and B.

Why 0.995: the default bands give the first layer 6 bits and the second 5 (the tiny
model has two layers; docs/configuration.md, `layer_bits`). Uniform quantisation with
step s has an error of about s / sqrt(12) per value; at 5 bits over a channel's range
r that is r / 107, against values whose RMS is about r / 4, so the cosine is about
1 - (4 / 107)^2 / 2 ≈ 0.9993 (measured: 0.9985 in the worst chunk, whose channels
have outlier tokens). 0.995 leaves room for such chunks and still fails on a wrong
scale, axis or layer order, which give cosines far below 0.99.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm_fixture import Step, connector_config, run_session

from kvmesh.common.chunk_codec import FILE_LAYOUT, Codec, check_payload, check_stored
from kvmesh.common.codecs import codec_by_id
from kvmesh.common.codecs.stored import layout_of
from kvmesh.services.worker.tiers.disk_format import CHUNK_SUFFIX
from kvmesh.services.worker.vllm.tiny_model import prompt_tokens

pytestmark = pytest.mark.timeout(900)

# A fixed prompt set: four unrelated 1000-token prompts (three 256-token chunks each).
PROMPTS = [prompt_tokens(1000, seed=100 + i) for i in range(4)]
MAX_TOKENS = 16
COSINE_BOUND = 0.995


def _steps() -> list[Step]:
    return [Step(p, max_tokens=MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("codec-vllm")
    disk, shared = root / "disk", root / "fs"
    shared.mkdir()  # an fs:// remote must exist (it is a mounted filesystem)
    disk_cfg = {"enabled": True, "path": str(disk), "max_size": "256MiB", "compression": "cachegen"}
    a_conn = connector_config(
        disk=disk_cfg, remote={"enabled": True, "url": f"fs://{shared}", "timeout_s": 5}
    )
    a = run_session(tiny_model, _steps(), connector=a_conn)
    b_conn = connector_config(disk=disk_cfg)
    b = run_session(tiny_model, _steps(), connector=b_conn)
    return a, b, disk, shared


def _files(root: Path) -> dict[str, Path]:
    return {f.name: f for f in root.rglob("*" + CHUNK_SUFFIX)}


def _read(path: Path):
    data = path.read_bytes()
    header = FILE_LAYOUT.parse(data[: FILE_LAYOUT.size])
    return header, memoryview(data)[FILE_LAYOUT.size :]


def test_greedy_completions_are_identical_with_cachegen_kv(runs) -> None:
    a, b, _, _ = runs
    for i, (sa, sb) in enumerate(zip(a.steps, b.steps, strict=True)):
        assert sa.hit_tokens == 0 and sa.kvmesh and sa.kvmesh["saved_tokens"] == 768, i
        assert sb.hit_tokens == 768 and sb.num_cached_tokens == 768, i
        assert sb.output_tokens == sa.output_tokens, f"prompt {i}: greedy output changed"
    deltas = []
    for sa, sb in zip(a.steps, b.steps, strict=True):
        first_a, first_b = sa.logprobs[0], sb.logprobs[0]
        deltas += [abs(first_a[t] - first_b[t]) for t in first_a.keys() & first_b.keys()]
    print(
        f"\ncachegen (default) on the tiny model, {len(PROMPTS)} prompts x {MAX_TOKENS} "
        f"greedy tokens: identical completions; first-token logprob change "
        f"max {max(deltas):.2e}, mean {sum(deltas) / len(deltas):.2e} (top-5 tokens)"
    )


def test_decoded_kv_stays_close_to_the_original(runs) -> None:
    _, _, disk, shared = runs
    lossy, raw = _files(disk), _files(shared)
    assert len(lossy) == len(raw) == 3 * len(PROMPTS)
    assert lossy.keys() == raw.keys()
    stored = original = 0
    max_err = 0.0
    cosines: list[list[float]] = []  # per chunk: [K layer 0, K layer 1, V layer 0, V layer 1]
    for name, path in sorted(lossy.items()):
        h, payload = _read(path)
        assert h.codec is Codec.CACHEGEN
        check_stored(h, payload)
        rh, rpayload = _read(raw[name])
        check_payload(rh, rpayload)
        x = torch.frombuffer(bytearray(rpayload), dtype=rh.dtype).view(rh.shape).float()
        y = codec_by_id(h.codec).decode(payload, layout_of(h)).float()
        assert y.shape == x.shape  # [2, layers, tokens, hidden]
        stored += FILE_LAYOUT.size + len(payload)
        original += FILE_LAYOUT.size + x.numel() * rh.dtype.itemsize
        max_err = max(max_err, (y - x).abs().max().item())
        cos = torch.nn.functional.cosine_similarity(y.flatten(2), x.flatten(2), dim=-1)
        cosines.append(cos.flatten().tolist())
    per = torch.tensor(cosines).amin(0).view(2, -1)
    print(
        f"\ncachegen on tiny-model KV ({rh.dtype}, chunk {tuple(rh.shape)}): ratio "
        f"{original / stored:.2f}x (files, headers included), max abs error {max_err:.4f}, "
        f"worst cosine per layer K {per[0].tolist()} V {per[1].tolist()}"
    )
    assert bool((per > COSINE_BOUND).all()), per
    assert original / stored > 2.0
