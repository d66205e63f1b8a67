"""One engine per (instance id, rank) in a process, shared by whoever asks for it."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvmesh.common.config import EngineConfig
from kvmesh.services.worker.engine import KVEngine

_engines: dict[tuple[str, int], tuple[KVEngine, EngineConfig]] = {}
_lock = threading.Lock()


class EngineConfigMismatch(ValueError):
    """An engine with this id exists already, built from another config."""


def get_or_create_engine(
    instance_id: str,
    rank: int,
    config: EngineConfig,
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | dict[str, torch.Tensor],
    **kwargs: Any,
) -> KVEngine:
    """The engine of (instance_id, rank): the existing one if its config is equal,
    a new one if there is none; raises EngineConfigMismatch otherwise."""
    key = (instance_id, rank)
    with _lock:
        found = _engines.get(key)
        if found is not None:
            engine, existing = found
            if existing != config:
                raise EngineConfigMismatch(
                    f"engine {instance_id}/{rank} exists with another config"
                )
            return engine
        engine = KVEngine(instance_id, rank, config, kv_caches, **kwargs)
        _engines[key] = (engine, config)
        return engine


def get_engine(instance_id: str, rank: int) -> KVEngine | None:
    with _lock:
        found = _engines.get((instance_id, rank))
    return found[0] if found else None


def destroy_engine(instance_id: str, rank: int) -> bool:
    """Close and forget the engine; False if there was none."""
    with _lock:
        found = _engines.pop((instance_id, rank), None)
    if found is None:
        return False
    found[0].close()
    return True


def destroy_all_engines() -> None:
    with _lock:
        engines = [e for e, _ in _engines.values()]
        _engines.clear()
    for engine in engines:
        engine.close()


# vLLM does not always shut its connector down when the process exits: close what is
# left, so puts still in flight to disk and remote get engine.close_flush_s to finish.
# threading's exit hooks run before atexit's, while pyzmq still sends: its zero-copy
# sends stop working once its own atexit hook has run. (concurrent.futures relies on
# the same private hook.)
_register_exit = getattr(threading, "_register_atexit", None)
if _register_exit is not None:
    _register_exit(destroy_all_engines)
else:
    atexit.register(destroy_all_engines)
