"""The name under which a vLLM instance's chunks are stored: which weights, and in which
variant, computed its KV.

Two instances share chunks only when their names match (the name is part of every
chunk key's namespace), so the name must change whenever the same weights would write
different KV. The KV dtype and the shape of a chunk are in the namespace or checked on
load already; what neither sees is a change of the numbers the weights produce:

- the weights quantized at load (`quantization="fp8"` on a bf16 checkpoint) keep the
  path, the KV dtype and the chunk shape, and change every K and V;
- `hf_overrides` and `hf_config_path` can change the rotary embedding
  (`rope_parameters`), the attention scaling or the layers themselves (the config they
  give is what is named);
- `code_revision` picks other modelling code for a remote-code model.

These are added to the name as `+factor=value` only when set, so the common case keeps
its readable name (a path, or `hub-id@commit`) and instances that differ in none of
them share. A hub id is pinned to the commit its files came from, since a branch moves
under it; a local directory's contents cannot be named cheaply, so replacing the weights
in place needs a new `engine.model_name` (docs/vllm.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from kvmesh.common.config.schema import UNSET_MODEL_NAME


def hub_commit(model: str, revision: str | None) -> str | None:
    """The commit a hub id (and branch or tag) resolves to in this host's Hugging Face
    cache, where vLLM fetched the model's files; None for a local directory or when the
    cache does not say."""
    if os.path.isdir(model):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ValueError, OSError):  # an id the hub would refuse, an unreadable cache
        return None
    if not isinstance(found, str):
        return None
    # <cache>/models--org--name/snapshots/<commit>/config.json
    snapshot = Path(found).parent
    return snapshot.name if snapshot.parent.name == "snapshots" else None


# <cache>/models--<org>--<name>/snapshots/<commit>: where vLLM, offline, swaps a hub id
# for its files (the hub forbids "--" in ids, so the id reads back unambiguously).
_SNAPSHOT = re.compile(r"(?:.*/)?models--(?P<id>.+?)/snapshots/(?P<commit>[0-9a-f]{40})/?")
# Keys of a model's config that name where it was read, not what it computes.
_CONFIG_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash")


def weights_name(model_config: Any) -> str:
    """The weights vLLM loads: their path or hub id, with the commit a hub id resolved
    to (a branch such as main moves when the repository changes), else the revision
    when one is set. vLLM resolves the commit once, before it downloads, and keeps it on
    the revision; failing that, the host's cache says (read later, it may have moved)."""
    model = str(model_config.model)
    snapshot = _SNAPSHOT.fullmatch(model)
    if snapshot is not None:
        return f"{snapshot['id'].replace('--', '/')}@{snapshot['commit']}"
    revision = getattr(model_config, "revision", None)
    pinned = getattr(revision, "resolved", None) or hub_commit(model, revision) or revision
    return f"{model}@{pinned}" if pinned else model


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _config_digest(model_config: Any) -> str:
    """The model config vLLM runs, after hf_overrides (a dict or a function) and from
    hf_config_path: what they change is what the KV depends on."""
    config = model_config.hf_config.to_dict()
    for key in _CONFIG_PROVENANCE:
        config.pop(key, None)
    return _digest(config)


def variant_suffix(model_config: Any) -> str:
    """`+factor=value` for each setting, besides the weights' path, that changes the KV
    those weights compute; "" when none is set."""
    parts = []
    quantization = getattr(model_config, "quantization", None)
    hf_config = getattr(model_config, "hf_config", None)
    # A checkpoint's own quantization is named by its path already (and vLLM's name
    # for it varies by platform); quantizing at load is not.
    if quantization and getattr(hf_config, "quantization_config", None) is None:
        parts.append(f"+quantization={quantization}")
    # Online quantization options, also over a quantized checkpoint: vLLM composes the
    # two (it may quantize the layers the checkpoint left in bf16, attention included).
    options = getattr(model_config, "quantization_config", None)
    if options:
        parts.append(f"+quantization_config={_digest(options)}")
    if getattr(model_config, "hf_overrides", None) or getattr(model_config, "hf_config_path", None):
        parts.append(f"+config={_config_digest(model_config)}")
    code_revision = getattr(model_config, "code_revision", None)
    if code_revision:
        parts.append(f"+code_revision={code_revision}")
    return "".join(parts)


def model_identity(model_config: Any, configured: str = UNSET_MODEL_NAME) -> str:
    """The namespace's model name: `engine.model_name` when set (it stands for the
    weights' path, which may differ between hosts), else the weights vLLM loads; then the
    variant suffix either way, which a configured name cannot know."""
    base = configured if configured != UNSET_MODEL_NAME else weights_name(model_config)
    return base + variant_suffix(model_config)
