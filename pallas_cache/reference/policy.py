"""The fetch policy of the hybrid path and its balanced split (docs/semantics.md §5.3), in plain Python ints.

A hybrid step that misses ``M`` distinct experts fetches ``F`` of them over the link and computes
the other ``M - F`` on the CPU. The split balances the two sides: with a fraction ``q`` of the
work going to the link, the slower side costs ``max(F * (1 - q), (M - F) * q)``, and ``F`` is the
integer that minimises it. ``q`` is turned into a 16-bit fixed-point integer once, on the host, so
no float ever enters a decision and the JAX implementation can reproduce every choice exactly.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

#: Fixed-point scale of the fraction: ``f = round_half_even(q * ONE)``.
ONE = 65536


def _require_number(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    if math.isnan(float(value)):
        raise ValueError(f"{what} must not be NaN, got {value!r}")


@dataclass(frozen=True)
class ReferencePolicy:
    """How many of a hybrid step's misses go over the link.

    Attributes:
      fraction16: the link's share ``q`` as ``round_half_even(q * 65536)`` clamped to
        ``[0, 65536]``; 0 means "use the cap".
      cap: the fixed number of fetches per step, used only when ``fraction16 == 0``.
    """

    fraction16: int
    cap: int

    def __post_init__(self):
        for name, low, high in (("fraction16", 0, ONE), ("cap", 0, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"ReferencePolicy.{name} must be an int, got {value!r}")
            if value < low or (high is not None and value > high):
                allowed = f"[0, {high}]" if high is not None else ">= 0"
                raise ValueError(f"ReferencePolicy.{name} must be {allowed}, got {value}")

    @classmethod
    def fraction(cls, q) -> "ReferencePolicy":
        """The balanced split at link share ``q`` (clamped to ``[0, 1]``; NaN is refused)."""
        _require_number(q, "fetch fraction")
        # Clamping q before rounding is the same clamp (rounding is monotone) and keeps
        # infinities out of round(), which is half-to-even in Python.
        return cls(fraction16=round(min(max(float(q), 0.0), 1.0) * ONE), cap=0)

    @classmethod
    def fixed_cap(cls, n) -> "ReferencePolicy":
        """At most ``n >= 0`` fetches per step, whatever the number of misses."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"fetch cap must be an int, got {n!r} ({type(n).__name__})")
        if n < 0:
            raise ValueError(f"fetch cap must be >= 0, got {n}")
        return cls(fraction16=0, cap=int(n))

    @classmethod
    def full(cls) -> "ReferencePolicy":
        """Fetch every miss (what ``ensure`` does): the split at ``q = 1``."""
        return cls(fraction16=ONE, cap=0)

    def split(self, missing: int) -> int:
        """The number of the ``missing`` distinct misses to fetch.

        A fraction is not combined with the cap, and there is no minimum of one: a single miss
        at ``q = 0.4`` is computed on the CPU (the PROMOTE_ONE admission rule is what rescues a
        recurring one).
        """
        f = self.fraction16
        if f == 0:
            return min(missing, self.cap)
        lo = missing * f // ONE

        def cost(fetch):
            return max(fetch * (ONE - f), (missing - fetch) * f)

        fetch = lo if cost(lo) <= cost(lo + 1) else lo + 1
        return min(fetch, missing)
