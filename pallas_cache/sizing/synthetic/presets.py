"""The named synthetic presets and :func:`synthetic_trace`, which generates either family."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pallas_cache.sizing.synthetic.realistic import RealisticParams, realistic_routes
from pallas_cache.sizing.synthetic.zipf_reuse import (SyntheticParams, layer_popularity,
                                                      zipf_reuse_routes)
from pallas_cache.sizing.traces import Trace, check_memory, resolve_memory_limit, trace_bytes
from pallas_cache.validate import is_int

__all__ = ["PRESETS", "checked_params", "synthetic_trace"]

#: Named parameter sets. ``mixtral-like``: Mixtral-8x7B geometry, near-flat routers (measured
#: mean normalised entropy about 0.97) and previous-token reuse about 0.37. ``fine-grained``:
#: many small experts (DeepSeek/Qwen-MoE style geometry) with clearly skewed, layer-varying
#: popularity and weaker reuse. The token-structured presets (``benchmarks/realistic_preset.py``
#: prints their statistics next to the measured Mixtral-8x7B ones): ``mixtral-realistic``,
#: Mixtral-8x7B geometry calibrated against two real decode traces (HumanEval and GSM8K prompts:
#: lag 1-8 repeats, neighbour and next-token precision, normalised entropy, LRU / per-layer LRU /
#: Belady hit rates at 2-6 slots per layer; docs/policies.md); ``fine-grained-realistic``, the
#: same token model on the fine-grained geometry, with a skewed router bias.
PRESETS: dict[str, SyntheticParams | RealisticParams] = {
    "mixtral-like": SyntheticParams(num_layers=32, num_experts=8, top_k=2, skew=0.85,
                                    skew_spread=0.3, reuse=0.37),
    "fine-grained": SyntheticParams(num_layers=48, num_experts=128, top_k=8, skew=1.2,
                                    skew_spread=0.4, reuse=0.25),
    "mixtral-realistic": RealisticParams(num_layers=32, num_experts=8, top_k=2),
    "fine-grained-realistic": RealisticParams(num_layers=48, num_experts=128, top_k=8, skew=0.4,
                                              skew_spread=0.4),
}


def checked_params(preset_or_params, num_tokens: int | None = None, seed: int = 0, *,
                   max_memory: int | None = None, geometry: dict | None = None):
    """``(params, label)`` of a :func:`synthetic_trace` call, every argument checked and nothing
    generated; raises exactly what :func:`synthetic_trace` raises for them."""
    if isinstance(preset_or_params, str):
        if preset_or_params not in PRESETS:
            raise KeyError(f"unknown synthetic preset {preset_or_params!r}; choose one of "
                           f"{sorted(PRESETS)}")
        params, label = PRESETS[preset_or_params], preset_or_params
    elif isinstance(preset_or_params, (SyntheticParams, RealisticParams)):
        params, label = preset_or_params, "custom"
    else:
        raise TypeError(f"expected a preset name, SyntheticParams or RealisticParams, got "
                        f"{type(preset_or_params).__name__}")
    changed = {field: value for field, value in (geometry or {}).items()
               if field in _GEOMETRY and getattr(params, field) != value}
    unknown = set(geometry or {}) - set(_GEOMETRY)
    if unknown:
        raise TypeError(f"geometry takes {', '.join(_GEOMETRY)}; got {sorted(unknown)}")
    if changed:
        for field, value in changed.items():
            if not is_int(value) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        params = replace(params, **changed)
        if params.top_k > params.num_experts:
            raise ValueError(f"top_k {params.top_k} exceeds num_experts {params.num_experts}")
        label += "[" + ", ".join(f"{_GEOMETRY[field]}={getattr(params, field)}"
                                 for field in _GEOMETRY) + "]"
    if num_tokens is not None:
        params = replace(params, num_tokens=num_tokens)
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

    calls = params.num_tokens * params.num_layers
    check_memory(4 * calls * params.top_k + 2 * trace_bytes(calls, params.top_k),
                 resolve_memory_limit(max_memory), f"synthetic:{label}",
                 f"num_tokens={params.num_tokens} ({calls} calls x top_k {params.top_k})")
    return params, label


#: The geometry fields a ``geometry=`` override may set, with their names in the trace's label.
_GEOMETRY = {"num_layers": "layers", "num_experts": "experts", "top_k": "top_k"}


def synthetic_trace(preset_or_params: str | SyntheticParams | RealisticParams,
                    num_tokens: int | None = None, seed: int = 0, *,
                    max_memory: int | None = None, geometry: dict | None = None) -> Trace:
    """Generate a seeded synthetic routing trace.

    Args:
        preset_or_params: a key of :data:`PRESETS` or a :class:`SyntheticParams`.
        num_tokens: overrides the parameters' token count (presets default to
            :data:`DEFAULT_PRESET_TOKENS`).
        seed: non-negative integer; the same seed and parameters give an identical trace, and
            a larger ``num_tokens`` with the same seed extends it (the first tokens are equal).
        max_memory: bytes the generated arrays may take (``None``: the trace module's
            ``default_memory_limit()``); checked before anything is generated.
        geometry: ``num_layers``, ``num_experts`` and/or ``top_k`` replacing the preset's (the
            other knobs kept); a changed geometry is named in the trace's ``source``, e.g.
            ``synthetic:fine-grained[layers=58, experts=256, top_k=8](tokens=..., seed=0)``.

    Returns:
        A dense trace: one sequence, tokens ``0..T-1``, each calling layers ``0..L-1`` in order
        with exactly ``top_k`` distinct experts (sorted ascending, no padding). Its ``source``
        names the preset and seed.

    Raises:
        KeyError: an unknown preset name (the message lists the presets).
        ValueError: invalid knobs or seed.
        MemoryLimitError: (a ``ValueError``) ``num_tokens`` whose arrays would exceed
            ``max_memory``.
    """
    params, label = checked_params(preset_or_params, num_tokens, seed, max_memory=max_memory,
                                   geometry=geometry)
    if isinstance(params, RealisticParams):
        return Trace.from_dense(realistic_routes(params, seed), num_layers=params.num_layers,
                                num_experts=params.num_experts,
                                source=f"synthetic:{label}(tokens={params.num_tokens}, "
                                       f"seed={seed})", max_memory=max_memory)
    rng = np.random.default_rng(seed)
    _, log_popularity = layer_popularity(params, rng)
    routes = zipf_reuse_routes(params, log_popularity, rng)
    return Trace.from_dense(routes, num_layers=params.num_layers,
                            num_experts=params.num_experts,
                            source=f"synthetic:{label}(tokens={params.num_tokens}, seed={seed})",
                            max_memory=max_memory)
