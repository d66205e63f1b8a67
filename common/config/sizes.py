"""Byte sizes written the way people write them: ``5GiB``, ``512MB``, ``1.5 GiB``, ``64k``.

Units (case is ignored; there are no bit units, so ``Mb`` means megabytes):

- none or ``B``: bytes
- SI, powers of 1000: ``kB``/``KB``, ``MB``, ``GB``, ``TB``
- IEC, powers of 1024: ``KiB``, ``MiB``, ``GiB``, ``TiB`` (``Ki``, ``Mi``... also accepted)
- bare ``K``, ``M``, ``G``, ``T``: powers of 1024, as memory sizes usually mean

A fractional number is allowed (``1.5GiB``); the result is rounded down to whole bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

_KIB = 1024
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": _KIB,
    "mib": _KIB**2,
    "gib": _KIB**3,
    "tib": _KIB**4,
    "ki": _KIB,
    "mi": _KIB**2,
    "gi": _KIB**3,
    "ti": _KIB**4,
    "k": _KIB,
    "m": _KIB**2,
    "g": _KIB**3,
    "t": _KIB**4,
}

# Display order for format_size: the canonical spelling of each unit.
_IEC_DISPLAY = (("TiB", _KIB**4), ("GiB", _KIB**3), ("MiB", _KIB**2), ("KiB", _KIB))
_SI_DISPLAY = (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000))

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

SIZE_SYNTAX = "a byte count or a number with a unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"


def parse_size(value: str | int) -> int:
    """Return the number of bytes `value` names; raise ValueError when it names none."""
    # bool is an int subclass; `max_size: true` is a mistake, not one byte.
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got a boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size ({SIZE_SYNTAX}), got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if match is None:
        if value.strip().startswith("-"):
            raise ValueError(f"size must not be negative, got {value!r}")
        raise ValueError(f"invalid size {value!r}: expected {SIZE_SYNTAX}")
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(f"invalid size {value!r}: unknown unit {unit!r}; expected {SIZE_SYNTAX}")
    # Fraction keeps "1.1GB" and 30-digit byte counts exact, where a float (or a
    # Decimal at its default precision) would land some bytes off.
    return int(Fraction(number) * multiplier)


def format_size(n: int) -> str:
    """Return the shortest exact spelling of `n` bytes that parse_size reads back to `n`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"expected a non-negative byte count, got {n!r}")
    best = f"{n}B"
    for table in (_IEC_DISPLAY, _SI_DISPLAY):
        for name, unit in table:
            if n < unit:
                continue
            # At most three decimals keeps the spelling readable; anything finer is
            # better shown in a smaller unit or in bytes.
            if (n * 1000) % unit:
                continue
            text = f"{_decimal(n, unit)}{name}"
            if len(text) < len(best):
                best = text
    return best


def _decimal(n: int, unit: int) -> str:
    """`n / unit` in decimal; the caller made sure it has at most three decimals."""
    whole, rest = divmod(n, unit)
    if not rest:
        return str(whole)
    return f"{whole}.{rest * 1000 // unit:03d}".rstrip("0")


class ByteSize(int):
    """A non-negative byte count that config files may write as ``"5GiB"``.

    It is an int in every other way, so code using the config does plain arithmetic.
    """

    def __new__(cls, value: str | int = 0) -> ByteSize:
        return super().__new__(cls, parse_size(value))

    def __repr__(self) -> str:
        return f"ByteSize({format_size(int(self))!r})"

    def human(self) -> str:
        return format_size(int(self))
