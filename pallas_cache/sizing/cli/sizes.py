"""What ``--cache-size`` means, decided here alone: each value read once into a
:class:`CacheSize` (the user's spelling and its slots), and a request's sizes resolved at a
trace's geometry into the :class:`SweepSizes` the sweep replays and the printer shows (the
``auto`` grid, the pool past every expert, the ``--device-budget`` fit). No JAX, no NumPy."""

from __future__ import annotations

import dataclasses
import re

from pallas_cache.sizing.cli.checks import INT32_MAX
from pallas_cache.sizing.sweep.records import auto_cache_sizes
from pallas_cache.sizing.units import format_bytes, parse_bytes

__all__ = ["CacheSize", "SweepSizes", "budget_fit", "resolve_sizes"]

_ASCII_SLOTS = re.compile(r"[0-9]+")
_NEGATIVE = re.compile(r"\s*-\s*[0-9.]+\s*[a-zA-Z]*\s*")


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """One ``--cache-size`` value, read once (:meth:`parse`).

    Attributes:
      text: the user's spelling (``auto``, ``64``, ``12GiB``).
      slots: the slots it asks for, in ``[1, 2**31)``: the count given, or a byte size's whole
        experts of ``W`` (``None``: ``auto``, the grid at the trace's geometry).
      nbytes: a byte spelling's bytes (``None`` otherwise).
    """

    text: str
    slots: int | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, text: str, expert_bytes: int | None) -> "CacheSize":
        """``auto``, a slot count in ``[1, 2**31)``, or bytes that make at least one and at most
        ``2**31 - 1`` slots of ``expert_bytes`` (``W``; ``None``: bytes are refused).

        Raises:
          ValueError: the one line the CLI prints, naming the value.
        """
        if text == "auto":
            return cls(text)
        if _ASCII_SLOTS.fullmatch(text):
            if not 1 <= int(text) <= INT32_MAX:
                raise ValueError(f"cache size {text} is outside [1, {INT32_MAX}] slots")
            return cls(text, int(text))
        if _NEGATIVE.fullmatch(text):
            raise ValueError(f"cache size {text!r} must be positive: a slot count (at least one "
                             f"layer's experts) or bytes such as 12GiB")
        try:
            wanted = parse_bytes(text)
        except ValueError:
            raise ValueError(f"cache size {text!r} is not auto, a slot count (ASCII digits) or "
                             f"bytes such as 12GiB") from None
        if expert_bytes is None:
            raise ValueError(f"cache size {text!r} is in bytes: give --model or --expert-bytes "
                             f"to turn it into slots")
        slots = wanted // expert_bytes
        if not 1 <= slots <= INT32_MAX:
            raise ValueError(f"cache size {text} is {slots} slots of {expert_bytes} bytes, "
                             f"outside [1, {INT32_MAX}]")
        return cls(text, slots, wanted)


@dataclasses.dataclass(frozen=True)
class SweepSizes:
    """A request's cache sizes at one trace's geometry: what the sweep replays and the lines
    above the table that say how they were reached.

    Attributes:
      slots: the distinct slot counts, ascending, each in ``[E, L*E]``.
      lines: how byte sizes became slots, which sizes were past every expert, and the
        ``--device-budget`` fit replayed beside the grid (each a ``size:`` line of the table).
    """

    slots: tuple[int, ...]
    lines: tuple[str, ...]


def budget_fit(cost, num_layers: int, num_experts: int) -> int | None:
    """The pool size that exactly fills ``--device-budget``: ``floor(budget / W)`` slots, at most
    ``L * E`` (every expert resident; a bigger pool holds nothing more); ``None`` without a
    budget or when it holds less than one layer's ``E`` experts."""
    if cost.device_budget is None or cost.expert_bytes is None:
        return None
    slots = min(cost.device_budget // cost.expert_bytes, num_layers * num_experts)
    return slots if slots >= num_experts else None


def resolve_sizes(sizes, cost, num_layers: int, num_experts: int, top_k: int) -> SweepSizes:
    """``sizes`` (:class:`CacheSize` values) at a geometry of ``L`` layers of ``E`` experts,
    ``top_k`` routes per call: ``auto`` as its grid, a size past every expert (``L*E``) replayed
    as ``L*E`` with a line saying so, and :func:`budget_fit`'s size sorted in beside them.

    Raises:
      ValueError: a size below one layer's ``E`` experts, or a geometry past the cache's int32
        counts (the one line the CLI prints).
    """
    width = cost.expert_bytes
    slots, lines = [], []
    for size in sizes:
        if size.slots is None:
            slots += auto_cache_sizes(num_layers, num_experts, top_k)
            continue
        if size.nbytes is not None:
            lines.append(f"{size.text} = {size.slots} slots of {format_bytes(width)} "
                         f"({format_bytes(size.slots * width)})")
            if size.slots < num_experts:
                raise ValueError(f"cache size {size.text} holds {size.slots} experts of "
                                 f"{format_bytes(width)}, fewer than one layer's {num_experts}")
        slots.append(size.slots)
    too_small = [s for s in slots if s < num_experts]
    if too_small:
        raise ValueError(f"cache size {min(too_small)} cannot hold one layer of "
                         f"{num_experts} experts")
    # A pool past every expert (L*E slots) holds nothing more: it is replayed as L*E, and a line
    # says so (its bytes would price slots nothing fills).
    every = num_layers * num_experts
    above = sorted({s for s in slots if s > every})
    if above:
        pool = f" ({format_bytes(every * width)})" if width else ""
        lines.append(f"{', '.join(map(str, above))} slots {'is' if len(above) == 1 else 'are'} "
                     f"more than every expert (L*E = {num_layers}*{num_experts}): replayed as "
                     f"{every}{pool}, every expert resident")
    slots = sorted({min(s, every) for s in slots})
    fit = budget_fit(cost, num_layers, num_experts)
    if fit is not None and fit not in slots:
        whole = " (every expert)" if fit == every else ""
        lines.append(f"--device-budget {format_bytes(cost.device_budget)} fits {fit} slots of "
                     f"{format_bytes(cost.expert_bytes)} ({format_bytes(fit * width)}){whole}: "
                     f"replayed beside the grid")
        slots = sorted([*slots, fit])
    _check_geometry(num_layers, num_experts, slots)
    return SweepSizes(tuple(slots), tuple(lines))


def _check_geometry(num_layers: int, num_experts: int, slots) -> None:
    """The trace's geometry and the cache sizes against the cache state's int32 counts."""
    if num_layers * num_experts > INT32_MAX:
        raise ValueError(f"{num_layers} layers x {num_experts} experts = "
                         f"{num_layers * num_experts} experts, above the cache's {INT32_MAX}")
    too_big = [size for size in slots if size > INT32_MAX]
    if too_big:
        raise ValueError(f"cache size {too_big[0]} is above the cache's {INT32_MAX} slots")
