"""The name under which a vLLM instance's chunks are stored: which weights, and in which
variant, computed its KV.

Two instances share chunks only when their names match (the name is part of every
chunk key's namespace), so the name must change whenever the same weights would write
different KV. The KV dtype and the shape of a chunk are in the namespace or checked on
load already; what neither sees is a change of the numbers the weights produce:

- the weights quantized at load (`quantization="fp8"` on a bf16 checkpoint) keep the
  path, the KV dtype and the chunk shape, and change every K and V;
- `hf_overrides` can change the rotary embedding (`rope_parameters`), the attention
  scaling or the layers themselves;
- `code_revision` picks other modelling code for a remote-code model.

These are added to the name as `+factor=value` only when set, so the common case keeps
its readable name (`path@revision`) and instances that differ in none of them share.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvmesh.common.config.schema import UNSET_MODEL_NAME


def weights_name(model_config: Any) -> str:
    """The weights vLLM loads: their path or hub id, with the revision when one is set."""
    revision = getattr(model_config, "revision", None)
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)


def _overrides_tag(overrides: Any) -> str:
    if callable(overrides):
        # A function's effect cannot be read; its name is the closest stable stand-in.
        return f"{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}"
    text = json.dumps(overrides, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def variant_suffix(model_config: Any) -> str:
    """`+factor=value` for each setting, besides the weights' path, that changes the KV
    those weights compute; "" when none is set."""
    parts = []
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        parts.append(f"+quantization={quantization}")
    overrides = getattr(model_config, "hf_overrides", None)
    if overrides:
        parts.append(f"+hf_overrides={_overrides_tag(overrides)}")
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
