"""Loading tiers and remote connectors that other installed packages provide.

A plugin is named either by an entry point of its group (`kvmesh.tiers`,
`kvmesh.connectors`), as an installed package declares it in its metadata, or by a
module path, `package.module:attribute`, for code on the Python path that is not a
package of its own. Either way it resolves to a factory; what the factory is given and
must return is the group's contract (services/worker/tiers/plugin.py for tiers,
remote_connector.py for connectors).

Every failure (no such entry point, an import error inside the plugin, a missing
attribute, a factory that raises or returns the wrong thing) is a PluginError naming the
plugin and its group, so a misconfigured engine stops at startup with a message that
says which plugin to fix, rather than later with a bare ImportError. A factory runs
under a deadline (FACTORY_TIMEOUT_S) on a thread of its own: one that waits forever (a
store that never answers its connect) fails the start instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import inspect
import re
import sys
import threading
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

TIERS_GROUP = "kvmesh.tiers"
CONNECTORS_GROUP = "kvmesh.connectors"

# How long a factory (with its module's import) may take before the start fails: a
# plugin may connect to its store there, but not wait for it forever.
FACTORY_TIMEOUT_S = 60.0

_MODULE_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class PluginError(RuntimeError):
    """A plugin could not be loaded or built; the message names it."""


def installed(group: str) -> dict[str, EntryPoint]:
    """The entry points of group, by name (nothing is imported)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def is_module_path(spec: str) -> bool:
    return _MODULE_PATH.fullmatch(spec) is not None


def load_factory(group: str, spec: str) -> Callable[..., Any]:
    """The callable that spec names: an entry point of group, or `module:attr`."""
    if is_module_path(spec):
        module_name, _, attr = spec.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:
            raise PluginError(
                f"{group} plugin {spec!r} did not load: {type(exc).__name__}: {exc}"
            ) from exc
    else:
        found = installed(group)
        if spec not in found:
            known = ", ".join(sorted(found)) or "none installed"
            raise PluginError(
                f"no {group} plugin named {spec!r} (installed: {known}); name an entry point "
                "or a module path as package.module:factory"
            )
        try:
            obj = found[spec].load()
        except Exception as exc:
            raise PluginError(
                f"{group} plugin {spec!r} ({found[spec].value}) did not load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if not callable(obj):
        raise PluginError(f"{group} plugin {spec!r} is a {type(obj).__name__}, not a factory")
    return obj


def build(group: str, spec: str, *args: Any, **kwargs: Any) -> Any:
    """Load and call spec's factory within FACTORY_TIMEOUT_S; whatever it raises, or a
    factory still running then, is a PluginError naming it. The factory runs on a
    daemon thread: a stuck one holds up neither this caller nor the process's exit. What
    it returns after the deadline is closed (a plain `close()`), nobody's to use."""

    device = _cuda_device()

    def load_and_call() -> Any:
        factory = load_factory(group, spec)
        try:
            if device is not None:
                # A thread starts on CUDA device 0; the factory allocates on the caller's.
                sys.modules["torch"].cuda.set_device(device)
            return factory(*args, **kwargs)
        except Exception as exc:
            raise PluginError(
                f"{group} plugin {spec!r} failed to start: {type(exc).__name__}: {exc}"
            ) from exc

    fut = call_on_daemon(load_and_call, name=f"kvmesh-plugin-start-{spec}")
    try:
        return fut.result(timeout=FACTORY_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        fut.add_done_callback(_close_late)
        raise PluginError(
            f"{group} plugin {spec!r} did not start within {FACTORY_TIMEOUT_S:g}s: its "
            "factory (or its module's import) is still running; does it wait on something "
            "that does not answer?"
        ) from None


def _cuda_device() -> int | None:
    """The caller's current CUDA device, where torch has initialised CUDA (a plugin
    module is not made to import torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _close_late(fut: concurrent.futures.Future) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    close = getattr(fut.result(), "close", None)
    if callable(close) and not inspect.iscoroutinefunction(close):
        # The start has failed already: that is the error worth reporting.
        with contextlib.suppress(Exception):
            close()


def call_on_daemon(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """fn() on a daemon thread of its own; its result or exception in the future."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def wrong_kinds(
    obj: Any, awaited: Iterable[str], called: Iterable[str], optional: Iterable[str] = ()
) -> list[str]:
    """What a plugin's object has of the wrong kind: a method its host awaits that is no
    `async def`, or one it calls directly that is. A host that awaits a plain function
    (or adds up a coroutine) fails at every request instead of at startup. Methods
    in `optional` may be missing."""
    skip = set(optional)
    wrong = [
        f"{m} is not async def"
        for m in awaited
        if not (m in skip and getattr(obj, m, None) is None)
        and not inspect.iscoroutinefunction(getattr(obj, m, None))
    ]
    wrong += [
        f"{m} is async def" for m in called if inspect.iscoroutinefunction(getattr(obj, m, None))
    ]
    return wrong
