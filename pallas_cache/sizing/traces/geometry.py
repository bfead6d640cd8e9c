"""A trace's geometry, declared or inferred: the id ranges, the outlier rule and its memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from pallas_cache.sizing.traces.memory import BYTES_PER_FLAT_ID, check_memory
from pallas_cache.sizing.traces.errors import TraceError
from pallas_cache.validate import INT32_MAX, is_int

__all__ = ["OUTLIER_RATIO", "OUTLIER_FLOOR", "check_geometry", "check_outlier", "next_largest",
           "expert_out_of_range", "id_past_int32", "optional_positive_int"]

#: Outlier rule for inferred geometry: the largest id ``m`` (layer or expert) is refused when
#: ``m >= OUTLIER_FLOOR`` and ``m + 1 > OUTLIER_RATIO * (n + 1)``, ``n`` being the next distinct
#: largest id (``-1`` when there is none), i.e. when the size it implies is more than 4x the size
#: the rest of the trace implies. Declaring the geometry skips the rule.
OUTLIER_RATIO = 4
OUTLIER_FLOOR = 1024


def check_geometry(num_layers: int, num_experts: int, limit: int, where: str,
                   declared: str) -> None:
    check_memory(num_layers * num_experts * BYTES_PER_FLAT_ID, limit, where,
                 f"the geometry {num_layers} layers x {num_experts} experts{declared} (per-expert "
                 f"tables of {num_layers * num_experts} entries)")


def check_outlier(kind: str, largest: int, next_largest: int, where: str) -> None:
    """Refuse an inferred size set by one id far above the rest (see :data:`OUTLIER_RATIO`)."""
    if largest >= OUTLIER_FLOOR and largest + 1 > OUTLIER_RATIO * (next_largest + 1):
        rest = (f"the next largest {kind} is {next_largest}" if next_largest >= 0
                else f"no other {kind} id occurs")
        raise TraceError(f"{where}: field {kind + 's' if kind == 'expert' else kind!r}: {kind} "
                         f"{largest} is an outlier ({rest}); inferring num_{kind}s="
                         f"{largest + 1} from it would size every per-{kind} table by this one "
                         f"id. Pass num_{kind}s= (--num-{kind}s) if it is real")


def next_largest(values: np.ndarray, largest: int) -> int:
    below = values[values < largest]
    return int(below.max()) if below.size else -1


def expert_out_of_range(where: str, expert: int, declared_experts: int | None) -> TraceError:
    """The one message for an expert id outside ``[-1, num_experts)`` or past int32, for the
    per-record and the vectorised readers alike."""
    if expert < -1:
        return TraceError(f"{where}: field 'experts': expert {expert} is below -1 (-1 is the only "
                          f"padding value)")
    if declared_experts is not None and expert >= declared_experts:
        return TraceError(f"{where}: field 'experts': expert {expert} is outside "
                          f"[-1, {declared_experts}) (num_experts={declared_experts})")
    return TraceError(f"{where}: field 'experts': {id_past_int32('expert', expert)}")


def id_past_int32(name: str, value: int) -> str:
    """Why an id at or past ``2**31 - 1`` is refused: past it the id itself does not fit int32;
    at it the id fits, but the count it implies (``max + 1``) does not."""
    if value > INT32_MAX:
        return f"{name} {value} does not fit int32"
    count = "num_layers" if name == "layer" else "num_experts"
    return (f"{name} {value} fits int32, but {count} = {value} + 1 = 2**31 would not (ids "
            f"must be below 2**31 - 1)")


def optional_positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return int(value)
