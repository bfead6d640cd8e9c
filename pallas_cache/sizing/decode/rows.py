"""What a decode run reports: each row measured and modeled (:class:`Row`), the run
(:class:`DecodeRun`), the per-call count histograms checked against the replay's, and the line
naming the parameter that closes a row's gap with the model (:func:`gap_line`)."""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from pallas_cache.sizing.decode.bank import Geometry
from pallas_cache.sizing.decode.parameters import Parameters
from pallas_cache.sizing.units import format_bandwidth

__all__ = ["ATTENTION_LINE", "DecodeRun", "Row", "call_histogram", "distinct_per_call",
           "gap_line"]

#: What the decode leaves out, said once wherever its numbers are shown.
ATTENTION_LINE = ("each layer is its MoE block alone: no attention, dense layers or LM head; the "
                  "router is the trace's routes (random gates)")


@dataclasses.dataclass(frozen=True)
class Row:
    """One decoded row, measured and modeled (the keys of ``--format json``)."""

    row: str
    kind: str
    cache_size: int
    policy: str
    eviction: str
    measured_ms_per_token: float
    tokens_per_second: float
    fetched_per_token: float
    cpu_experts_per_token: float
    compile_seconds: float
    modeled_ms_per_token: float
    measured_over_modeled: float
    counts_checked_against: str
    call_counts: tuple = ()

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["call_counts"] = [list(c) for c in self.call_counts]
        return out


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """What :func:`bench_decode` measured: the rows, the parameters, the notes to print."""

    geometry: Geometry
    trace_source: str
    tokens: int
    bank_memory: str | None
    rows: tuple
    parameters: Parameters
    notes: tuple
    gaps: tuple


def call_histogram(hits, fetched, cpu) -> tuple:
    """``((hits, fetched, cpu_experts, calls), ...)`` sorted, from per-call count arrays."""
    counter = collections.Counter(zip(np.ravel(hits).tolist(), np.ravel(fetched).tolist(),
                                      np.ravel(cpu).tolist()))
    return tuple(sorted((h, f, c, n) for (h, f, c), n in counter.items()))


def distinct_per_call(routes: np.ndarray) -> np.ndarray:
    """int ``[T, L]``: the distinct non-padding experts of each call of ``routes [T, L, k]``."""
    routes = np.asarray(routes)
    ordered = np.sort(routes, axis=-1)
    new = np.concatenate([np.ones(ordered.shape[:-1] + (1,), bool),
                          ordered[..., 1:] != ordered[..., :-1]], axis=-1)
    return np.sum(new & (ordered >= 0), axis=-1)


def gap_line(row: Row, params: Parameters, call_counts, expert_bytes: int, tokens: int,
             threshold: float = 0.15) -> str | None:
    """A line naming the one parameter that, scaled alone, closes ``row``'s gap with the
    smallest change (``None`` within ``threshold``)."""
    if abs(row.measured_over_modeled - 1.0) <= threshold:
        return None
    target = row.measured_ms_per_token
    best = None
    for name in Parameters.NAMES:
        value = getattr(params, name)
        if not value:
            continue
        scale = _closing_scale(lambda s: _with(params, name, value * s).ms_per_token(
            call_counts, expert_bytes, tokens), target)
        if scale is not None and (best is None or abs(math.log(scale)) < abs(math.log(best[1]))):
            best = (name, scale)
    ratio = f"measured/modeled {row.measured_over_modeled:.2f}"
    if best is None:
        return f"{row.row}: {ratio}; no single parameter closes the gap"
    name, scale = best
    value = getattr(params, name)
    shown = (lambda v: format_bandwidth(v)) if "bandwidth" in name else (
        lambda v: f"{v * 1e3:.4g} ms")
    return (f"{row.row}: {ratio}; {Parameters.NAMES[name]} explains most of it: the model "
            f"matches with {shown(value * scale)} instead of {shown(value)} (x{scale:.3g})")


def _with(params: Parameters, name: str, value: float) -> Parameters:
    """``params`` with one field changed."""
    return dataclasses.replace(params, **{name: value})


def _closing_scale(model, target, low=1e-4, high=1e4, steps=80):
    """The scale ``s`` in ``[low, high]`` with ``model(s) == target`` (``model`` monotone in
    ``s``), by bisection on ``log s``; ``None`` if the target is outside its range there."""
    a, b = model(low), model(high)
    if not min(a, b) <= target <= max(a, b) or a == b:
        return None
    lo, hi = math.log(low), math.log(high)
    rising = b > a
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (model(math.exp(mid)) < target) == rising:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)
