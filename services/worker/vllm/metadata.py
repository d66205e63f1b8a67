"""What the scheduler-role connector tells the worker-role connectors each step.

One `KvmeshConnectorMetadata` per step: the loads to do before the forward pass and
the saves to do after it. vLLM pickles it to every worker process, so it holds only
plain data: token ids as an int32 tensor, block ids as lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadOp:
    """Load the cached KV of tokens[skip:] into the request's blocks.

    tokens: the prompt prefix whose chunks the lookup found (a whole number of
    chunks, so it may reach one token past what the scheduler counts as loaded).
    skip: leading tokens vLLM has already (a multiple of the chunk size).
    local: the tokens vLLM computed itself (its prefix-cache hit, block-aligned;
    >= skip). The chunk across it is loaded whole, but its blocks below `local` stay
    valid when that load fails: they may be shared with other running requests.
    """

    req_id: str
    tokens: torch.Tensor
    block_ids: list[int]
    skip: int = 0
    tenant: str = ""
    local: int = 0


@dataclass
class SaveOp:
    """Store the chunks of tokens[skip:] from the request's blocks (skip: tokens
    already saved by an earlier step, a multiple of the chunk size). With pd_transfer,
    push them to the decoder at pd_endpoints[rank] (and store them here too)."""

    req_id: str
    tokens: torch.Tensor
    block_ids: list[int]
    skip: int = 0
    tenant: str = ""
    pd_transfer: str = ""
    pd_endpoints: list[str] = field(default_factory=list)


@dataclass
class FailedLoad:
    """A load the scheduler counted but could not plan: the worker reports the blocks
    of tokens [first, end) as failed, so vLLM recomputes them."""

    req_id: str
    block_ids: list[int]
    first: int
    end: int


@dataclass
class KvmeshConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    failed: list[FailedLoad] = field(default_factory=list)


def token_tensor(tokens: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int32)


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The cache slot of each of the first num_tokens tokens of a block table."""
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    blocks = torch.tensor(block_ids[:needed], dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets).flatten()[:num_tokens]
