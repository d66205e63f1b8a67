"""A tiny randomly initialised Llama and a locally trained tokenizer, built offline.

No model hub is reachable from CI, so tests, `kvmesh demo` and the benchmarks build
their model here: random weights from a fixed seed (the same spec gives the same
weights on every machine), a byte-level BPE tokenizer trained on generated text, and
a stamp file so a second call finds the model and returns at once. Needs
`transformers` and `tokenizers` (both come with the `vllm` extra).

    spec = TinyModelSpec()                      # 2 layers, hidden 128, head_dim 32
    path = build_tiny_model(spec)               # ~/.cache/kvmesh/models/tiny-llama-<hash>
    ids = prompt_tokens(1000, seed=1, vocab_size=spec.vocab_size)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

_STAMP = "kvmesh-tiny-model.json"
# Ids below this are the tokenizer's special and byte tokens; prompts avoid them so a
# prompt never contains an end-of-sequence token.
FIRST_PROMPT_TOKEN = 300


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """The model's shape. vLLM on CPU needs head_dim >= 32."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.head_dim < 32:
            raise ValueError("head_dim must be >= 32 (vLLM's CPU attention needs it)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size <= FIRST_PROMPT_TOKEN + 100:
            raise ValueError(f"vocab_size must be > {FIRST_PROMPT_TOKEN + 100}")

    @property
    def name(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return f"tiny-llama-{hashlib.sha256(blob).hexdigest()[:12]}"


# A model whose prefill dominates a request on CPU (8 layers, hidden 512, ~25M
# parameters): what `kvmesh demo` and benchmarks/ttft.py serve. Prompts up to 8k tokens.
PREFILL_BOUND = TinyModelSpec(
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=8448,
)


def default_models_dir() -> Path:
    """$KVMESH_MODELS_DIR, else $XDG_CACHE_HOME/kvmesh/models (~/.cache/kvmesh/models)."""
    env = os.environ.get("KVMESH_MODELS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvmesh" / "models"


def build_tiny_model(spec: TinyModelSpec | None = None, root: Path | None = None) -> Path:
    """The directory of the model for spec under root, building it if missing.

    Building takes a few seconds; it writes into a temporary directory and renames it
    into place, so concurrent builders and interrupted builds leave no half model.
    """
    spec = spec or TinyModelSpec()
    root = Path(root) if root is not None else default_models_dir()
    target = root / spec.name
    if (target / _STAMP).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        _write_tokenizer(tmp, spec)
        _write_model(tmp, spec)
        (tmp / _STAMP).write_text(json.dumps(dataclasses.asdict(spec), indent=1))
        _share(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / _STAMP).is_file():  # not another builder's finished copy
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _share(path: Path) -> None:
    """Make the model readable by every user: mkdtemp's directory is 0700 (and the
    writers' files follow the umask), but one cache is shared by services that run as
    other users (docker/Dockerfile's, a test's subprocesses)."""
    for dirpath, _dirs, files in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)


def prompt_tokens(n: int, seed: int = 0, vocab_size: int = 1024) -> list[int]:
    """n pseudo-random token ids (no special tokens), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(n)]


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]
    return [" ".join(rng.choices(words, k=rng.randint(5, 20))) for _ in range(lines)]


def _write_tokenizer(path: Path, spec: TinyModelSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(path)


def _write_model(path: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(path, safe_serialization=True)
