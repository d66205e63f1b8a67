"""Looking keys up in the schema: the type at a dotted path, and what a typo meant."""

from __future__ import annotations

import difflib
import functools
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec


def strip_annotated(tp: Any) -> Any:
    """The bare type under ``Annotated[T, Meta(...)]``."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a Literal field, or None for any other type."""
    tp = strip_annotated(tp)
    return get_args(tp) if get_origin(tp) is Literal else None


@functools.cache
def struct_fields(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """Field name -> bare type for one Struct (cached: the schema never changes)."""
    return {f.name: strip_annotated(f.type) for f in msgspec.structs.fields(struct)}


def type_at(root: type[msgspec.Struct], path: tuple[str, ...]) -> Any | None:
    """The type of the field at `path` under `root`, or None when no such field exists."""
    tp: Any = root
    for key in path:
        if not is_struct(tp):
            return None
        tp = struct_fields(tp).get(key)
        if tp is None:
            return None
    return tp


def close_match(word: str, choices: list[str]) -> str | None:
    """The choice `word` most likely misspells, if any is close enough to suggest."""
    found = difflib.get_close_matches(word.lower(), choices, n=1, cutoff=0.6)
    return found[0] if found else None


def suggest_key(root: type[msgspec.Struct], path: tuple[str, ...]) -> tuple[str, ...] | None:
    """For an unknown key at `path`, the existing sibling path it most likely means."""
    parent = type_at(root, path[:-1])
    if not is_struct(parent):
        return None
    match = close_match(path[-1], list(struct_fields(parent)))
    return (*path[:-1], match) if match else None


def resolve_flat(root: type[msgspec.Struct], tokens: list[str]) -> tuple[str, ...] | None:
    """Split ``["engine", "l1", "max", "size"]`` into an existing leaf path, if one fits.

    Environment variable names lose the difference between "_" inside a name and "__"
    between levels when mistyped; this recovers the intended key for the suggestion.
    """
    fields = struct_fields(root)
    for cut in range(1, len(tokens) + 1):
        name = "_".join(tokens[:cut])
        tp = fields.get(name)
        if tp is None:
            continue
        if cut == len(tokens):
            return None if is_struct(tp) else (name,)
        if is_struct(tp):
            rest = resolve_flat(tp, tokens[cut:])
            if rest is not None:
                return (name, *rest)
    return None
