"""Byte sizes and bandwidths as people write them: ``336MiB``, ``24GiB``, ``25GB/s``, ``60 GB/s``.

The one byte grammar of the command line. Decimal prefixes are powers of 1000, binary ones
powers of 1024, a bare number is bytes. A size of the model (``--cache-size``, ``--expert-bytes``,
``--device-budget``) and a bandwidth are case-sensitive, a lower-case ``b`` there means bits and
is refused (docs/semantics.md §11.1), and ``8gb`` is not a cache size. A memory limit
(``--max-memory``, :func:`parse_memory_size`) is read case-insensitively over the same prefixes,
so ``8gb`` is 8 * 10**9 bytes there: a limit on the process's memory is never in bits. Parsers
raise ``ValueError`` naming the text.
"""

from __future__ import annotations

import decimal
import math
import re

__all__ = ["NUMBER", "parse_bytes", "parse_bandwidth", "parse_duration", "parse_memory_size",
           "format_bytes", "format_bandwidth", "format_duration", "scaled"]

#: The one reading of a number on the command line: ASCII digits, an optional fraction and
#: exponent (``float()`` and ``Decimal()`` also take ``'٠.٠٧'`` and ``'０.０７'``).
NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
# Decimal arithmetic over every exponent a text can hold, nothing trapped: a product past the
# double range is an infinity (refused as such), never a decimal.Overflow.
_EXACT = decimal.Context(prec=40, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def scaled(number: str, scale: str) -> float:
    """``number * scale``, both decimal texts, as the double nearest the decimal product: 0.07
    ms is ``7e-05`` s, as ``0.07 / 1000`` is written, not ``0.07 * 1e-3`` =
    ``7.000000000000001e-05``; ``inf`` or ``0.0`` beyond the double range, ``nan`` for nan."""
    return float(_EXACT.multiply(_EXACT.create_decimal(number), _EXACT.create_decimal(scale)))

_PREFIX = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
_QUANTITY = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
                       r"(?P<unit>(?P<prefix>[kKMGT]i?)?(?P<b>[Bb])?)\s*$")


def _parse(text: str, what: str, example: str, quantity: str | None = None) -> float:
    """The number of ``quantity`` (default: ``text``) in units; errors quote ``text``."""
    match = _QUANTITY.match(str(text if quantity is None else quantity))
    if match is None or (match.group("prefix") and not match.group("b")):
        raise ValueError(f"bad {what} {text!r}: expected a number with a unit such as {example}")
    if match.group("b") == "b":
        raise ValueError(f"bad {what} {text!r}: 'b' means bits; write bytes with a capital B "
                         f"(e.g. {example})")
    value = float(match.group("number")) * _PREFIX[match.group("prefix") or ""]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bad {what} {text!r}: must be positive")
    return value


def parse_bytes(text: str) -> int:
    """``"336MiB"`` -> ``352321536``; ``"24GB"`` -> ``24 * 10**9``; a bare number is bytes.

    A fractional byte count rounds down (``"1.5KiB"`` is 1536, ``"0.5B"`` is refused as 0).
    """
    value = int(_parse(text, "byte size", "336MiB, 24GiB or 12GB"))
    if value < 1:
        raise ValueError(f"bad byte size {text!r}: less than one byte")
    return value


#: :func:`parse_memory_size`'s units: every prefix of :data:`_PREFIX`, lower-case, with or
#: without ``b`` (a binary one with it only): ``g``, ``gb``, ``gib``.
_MEMORY_UNITS = {prefix.lower() + b: scale for prefix, scale in _PREFIX.items()
                 for b in (("b",) if prefix.endswith("i") else ("", "b"))}
_MEMORY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_memory_size(text: str) -> int:
    """A memory limit: ``8GiB``, ``512MiB``, ``8gb``, ``2e9``, ``1000000`` -> bytes; the unit
    case-insensitive (see the module's note), a fraction of a byte rounded down, at least 1 and
    below ``2**63``."""
    match = _MEMORY.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"{text!r} is not a memory size (e.g. 8GiB, 512MiB, 2e9)")
    number = float(match.group(1)) * _MEMORY_UNITS[unit]
    if not number < 2**63:
        raise ValueError(f"{text!r} is above the largest memory size, 2**63 - 1 bytes")
    value = int(number)
    if value < 1:
        raise ValueError(f"{text!r} is not a positive memory size")
    return value


def parse_bandwidth(text: str) -> float:
    """``"25GB/s"`` -> ``25e9`` bytes per second; ``GiB/s``, ``MB/s``, ``MiB/s`` and so on too."""
    stripped = str(text).strip()
    if not stripped.endswith("/s"):
        raise ValueError(f"bad bandwidth {text!r}: expected bytes per second such as 25GB/s, "
                         f"12GiB/s or 800MB/s")
    return _parse(text, "bandwidth", "25GB/s, 12GiB/s or 800MB/s", stripped[:-2])


def format_bytes(count: float) -> str:
    """Binary units: ``352321536`` -> ``"336MiB"``, ``2**34`` -> ``"16.0GiB"`` (one decimal below 100)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}"
    return f"{count:.0f}B"


def format_bandwidth(rate: float) -> str:
    """Decimal units: ``25e9`` -> ``"25GB/s"``."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.4g}{unit}"
    return f"{rate:.4g}B/s"


_DURATION = re.compile(rf"^\s*(?P<number>{NUMBER})\s*(?P<unit>s|ms|us|µs|ns)\s*$")
_SECONDS = {"s": "1", "ms": "1e-3", "us": "1e-6", "µs": "1e-6", "ns": "1e-9"}


def parse_duration(text: str, *, finite: bool = True) -> float:
    """``"0.08ms"`` -> ``8e-5`` seconds; ``s``, ``ms``, ``us`` (or ``µs``) and ``ns``; the unit is
    required, and 0 is allowed (``"0ms"``). ``finite=False``: a time past the double range is
    ``inf`` (for the caller to refuse in its own words) rather than a ValueError."""
    match = _DURATION.match(str(text))
    if match is None:
        raise ValueError(f"bad duration {text!r}: expected a number with a unit such as "
                         f"0.08ms, 80us or 0s")
    value = scaled(match.group("number"), _SECONDS[match.group("unit")])
    if finite and not math.isfinite(value):
        raise ValueError(f"bad duration {text!r}: not finite")
    return value


def format_duration(seconds: float) -> str:
    """``8e-5`` -> ``"0.08ms"``: milliseconds to 4 significant digits (``parse_duration`` reads
    it back)."""
    return f"{seconds * 1e3:.4g}ms"
