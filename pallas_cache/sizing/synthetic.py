"""Seeded synthetic routing traces, and the statistics that describe any trace.

Real routing traces are large, model-specific and often private; sizing a cache, testing a
replay, or comparing policies needs traces whose character is *known*. Two properties of routing
decide how an expert cache behaves, so they are the generator's knobs:

* **popularity skew** -- how unevenly a layer's router spreads its routes over experts. A flat
  router (Mixtral: normalised routing entropy about 0.97) leaves little for any cache policy to
  exploit; a skewed one (fine-grained MoE with many small experts) rewards keeping the hot ones.
  Each layer gets a Zipf popularity ``p[rank] ~ 1 / rank**s`` over a seeded random permutation of
  its experts (so the hot experts differ per layer), with exponent ``s`` per layer.
* **temporal reuse** -- how often the next token routes an expert the previous token routed at the
  same layer (Mixtral: about 0.35-0.40). This is what an LRU cache feeds on even when popularity
  is flat.

The model, per token ``t`` and layer ``l`` (``K = top_k``, experts within one call are distinct):

1. each of the previous token's ``K`` experts at ``l`` is kept independently with probability
   ``reuse``;
2. the remaining ``K - kept`` experts are drawn without replacement, proportionally to the
   layer's popularity, from the experts the previous token did **not** route (when ``E < 2K``
   there may be too few; the draw then falls back to the previous token's dropped experts).

Excluding the previous experts from the fresh draw makes ``reuse`` *exactly* the expected
previous-token reuse rate that :func:`trace_statistics` measures (without it the measured rate
would be ``reuse`` plus the chance overlap of two independent draws, about ``K/E`` on a flat
router). The price is a mild flattening of the realised popularity relative to ``p``, which is why
the preset exponents are calibrated against the *measured* entropy, not the formula.

Sampling uses the Gumbel-top-k trick (``argsort(log p + Gumbel)``), one vectorised draw over all
layers per token, so a 48-layer x 2000-token trace takes well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from pallas_cache.sizing.trace import Trace, check_memory, resolve_memory_limit, trace_bytes

__all__ = [
    "SyntheticParams",
    "PRESETS",
    "DEFAULT_PRESET_TOKENS",
    "synthetic_trace",
    "layer_exponents",
    "TraceStatistics",
    "trace_statistics",
]

#: Token count a preset generates when ``num_tokens`` is not given: long enough for stable
#: statistics (about 1k routes per layer on mixtral-like, 4k on fine-grained), short enough that a
#: CLI replay of a 48-layer preset finishes in seconds on a laptop CPU.
DEFAULT_PRESET_TOKENS = 512


def _finite_number(value: object) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, bool) and math.isfinite(float(value)))


def _check_exponent(value: float, name: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite Zipf exponent >= 0, got {value!r}")


@dataclass(frozen=True)
class SyntheticParams:
    """The knobs of the synthetic generator (see the module docstring for the model).

    Use ``dataclasses.replace(PRESETS["mixtral-like"], reuse=0.0)`` to vary one knob of a preset.

    Attributes:
        num_layers: ``L``, MoE layers (``>= 1``).
        num_experts: ``E``, experts per layer (``>= 1``).
        top_k: ``K``, distinct experts routed per (token, layer), ``1 <= K <= E``.
        num_tokens: decode tokens to generate (``>= 1``); the trace has ``num_tokens * L`` calls.
        skew: Zipf exponent of the per-layer popularity (``0`` = uniform; larger = more skewed),
            either one value for every layer (then varied by ``skew_spread``) or a sequence of
            ``L`` per-layer exponents used as given.
        skew_spread: how much the exponent varies across layers: layer ``l`` uses
            ``skew * (1 + skew_spread * u_l)`` with ``u_l`` uniform in ``[-1, 1]`` (seeded),
            clipped at 0. ``0`` gives every layer the same skew. Must be 0 when ``skew`` is a
            sequence.
        reuse: probability that each of the previous token's experts at a layer is routed again
            by this token at that layer, in ``[0, 1]``; equal to the expected previous-token
            reuse rate when ``E >= 2K``.
    """

    num_layers: int
    num_experts: int
    top_k: int
    num_tokens: int = DEFAULT_PRESET_TOKENS
    skew: float | tuple[float, ...] = 0.0
    skew_spread: float = 0.0
    reuse: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a "
                             f"call routes distinct experts")
        if isinstance(self.skew, (int, float, np.integer, np.floating)) \
                and not isinstance(self.skew, bool):
            _check_exponent(float(self.skew), "skew")
        else:
            try:
                per_layer = tuple(float(s) for s in self.skew)  # type: ignore[union-attr]
            except TypeError:
                raise ValueError(f"skew must be a number or a sequence of num_layers numbers, "
                                 f"got {self.skew!r}") from None
            if len(per_layer) != self.num_layers:
                raise ValueError(f"skew has {len(per_layer)} per-layer values but num_layers="
                                 f"{self.num_layers}")
            for layer, value in enumerate(per_layer):
                _check_exponent(value, f"skew[{layer}]")
            if self.skew_spread != 0:
                raise ValueError("skew_spread must be 0 when skew gives per-layer values")
            object.__setattr__(self, "skew", per_layer)
        if not _finite_number(self.skew_spread) or self.skew_spread < 0:
            raise ValueError(f"skew_spread must be a finite number >= 0, got "
                             f"{self.skew_spread!r}")
        if not _finite_number(self.reuse) or not 0.0 <= self.reuse <= 1.0:
            raise ValueError(f"reuse must be a probability in [0, 1], got {self.reuse!r}")


#: Named parameter sets. ``mixtral-like``: Mixtral-8x7B geometry, near-flat routers (measured
#: mean normalised entropy about 0.97) and previous-token reuse about 0.37. ``fine-grained``:
#: many small experts (DeepSeek/Qwen-MoE style geometry) with clearly skewed, layer-varying
#: popularity and weaker reuse.
PRESETS: dict[str, SyntheticParams] = {
    "mixtral-like": SyntheticParams(num_layers=32, num_experts=8, top_k=2, skew=0.85,
                                    skew_spread=0.3, reuse=0.37),
    "fine-grained": SyntheticParams(num_layers=48, num_experts=128, top_k=8, skew=1.2,
                                    skew_spread=0.4, reuse=0.25),
}


def layer_exponents(params: SyntheticParams, seed: int = 0) -> np.ndarray:
    """The Zipf exponent each layer uses for ``params`` and ``seed``.

    Args:
        params: generator knobs.
        seed: the same seed :func:`synthetic_trace` is given.

    Returns:
        float64 ``[num_layers]``.
    """
    return _layer_popularity(params, np.random.default_rng(seed))[0]


def synthetic_trace(preset_or_params: str | SyntheticParams, num_tokens: int | None = None,
                    seed: int = 0, *, max_memory: int | None = None) -> Trace:
    """Generate a seeded synthetic routing trace.

    Args:
        preset_or_params: a key of :data:`PRESETS` or a :class:`SyntheticParams`.
        num_tokens: overrides the parameters' token count (presets default to
            :data:`DEFAULT_PRESET_TOKENS`).
        seed: non-negative integer; the same seed and parameters give an identical trace, and
            a larger ``num_tokens`` with the same seed extends it (the first tokens are equal).
        max_memory: bytes the generated arrays may take (``None``: the trace module's
            ``default_memory_limit()``); checked before anything is generated.

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
    if isinstance(preset_or_params, str):
        if preset_or_params not in PRESETS:
            raise KeyError(f"unknown synthetic preset {preset_or_params!r}; choose one of "
                           f"{sorted(PRESETS)}")
        params, label = PRESETS[preset_or_params], preset_or_params
    elif isinstance(preset_or_params, SyntheticParams):
        params, label = preset_or_params, "custom"
    else:
        raise TypeError(f"expected a preset name or SyntheticParams, got "
                        f"{type(preset_or_params).__name__}")
    if num_tokens is not None:
        params = replace(params, num_tokens=num_tokens)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

    calls = params.num_tokens * params.num_layers
    check_memory(4 * calls * params.top_k + 2 * trace_bytes(calls, params.top_k),
                 resolve_memory_limit(max_memory), f"synthetic:{label}",
                 f"num_tokens={params.num_tokens} ({calls} calls x top_k {params.top_k})")
    rng = np.random.default_rng(seed)
    _, log_popularity = _layer_popularity(params, rng)
    routes = _generate_routes(params, log_popularity, rng)
    return Trace.from_dense(routes, num_layers=params.num_layers,
                            num_experts=params.num_experts,
                            source=f"synthetic:{label}(tokens={params.num_tokens}, seed={seed})",
                            max_memory=max_memory)


def _layer_popularity(params: SyntheticParams, rng: np.random.Generator
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer Zipf exponents and unnormalised log-popularity ``[L, E]``.

    ``log p = -s * log(rank)`` stays finite for any exponent, so no expert gets probability
    exactly zero (which would tie with the ``-inf`` used to exclude experts in the draw).
    """
    layers, experts = params.num_layers, params.num_experts
    if isinstance(params.skew, tuple):
        exponents = np.asarray(params.skew, dtype=np.float64)
        rng.random(layers)  # keep the stream aligned with the scalar-skew case
    else:
        spread = rng.uniform(-1.0, 1.0, size=layers)
        exponents = np.maximum(0.0, params.skew * (1.0 + params.skew_spread * spread))
    ranks = np.stack([rng.permutation(experts) for _ in range(layers)]) + 1  # 1..E per layer
    return exponents, -exponents[:, None] * np.log(ranks.astype(np.float64))


def _generate_routes(params: SyntheticParams, log_popularity: np.ndarray,
                     rng: np.random.Generator) -> np.ndarray:
    """Draw ``[tokens, layers, top_k]`` routes (see the module docstring for the model)."""
    layers, experts, top_k = params.num_layers, params.num_experts, params.top_k
    layer_rows = np.arange(layers)[:, None]
    columns = np.arange(top_k)[None, :]
    # A dropped previous expert ranks below every other candidate but above the kept ones; it is
    # only reached when fewer than K - kept non-previous experts exist (E < 2K).
    dropped_penalty = 1e9 + 4.0 * float(np.abs(log_popularity).max())
    out = np.empty((params.num_tokens, layers, top_k), dtype=np.int32)

    keys = log_popularity + rng.gumbel(size=(layers, experts))
    previous = np.sort(np.argsort(-keys, axis=1)[:, :top_k], axis=1)
    out[0] = previous
    for token in range(1, params.num_tokens):
        keys = log_popularity + rng.gumbel(size=(layers, experts))
        keep = rng.random((layers, top_k)) < params.reuse
        keys[layer_rows, previous] = np.where(keep, -np.inf,
                                              keys[layer_rows, previous] - dropped_penalty)
        fresh = np.argsort(-keys, axis=1)[:, :top_k]
        kept_count = keep.sum(axis=1, keepdims=True)
        take_fresh = columns < top_k - kept_count
        # Row-major boolean selection yields, per layer, its kept experts then its fresh ones:
        # exactly K per layer, so the reshape is exact.
        chosen = np.concatenate([previous, fresh], axis=1)[np.concatenate([keep, take_fresh],
                                                                          axis=1)]
        previous = np.sort(chosen.reshape(layers, top_k), axis=1)
        out[token] = previous
    return out


# ---- statistics ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TraceStatistics:
    """Routing statistics of a trace, per routed layer and in the mean over routed layers.

    Layers with no (non-padding) route are absent, not zeros, as in the cache's skew report
    (docs/semantics.md §5.10): a layer without traffic says nothing about routing.

    Attributes:
        routed_layers: int ``[R]``, the layers with at least one route, ascending.
        routes: int64 ``[R]``, non-padding routes per routed layer (duplicates counted).
        norm_entropy: float64 ``[R]``, ``-sum p ln p / ln E`` of each layer's routing histogram;
            ``0.0`` when ``E == 1``. 1.0 = perfectly flat router.
        working_set: int64 ``[R]``, distinct experts routed at least once per layer.
        reuse_rate: float64 ``[R]``, per layer the share of a call's distinct experts that the
            previous call of that layer in the same sequence also routed (route-weighted over the
            calls that have a predecessor with routes); NaN for a layer with no such call.
        mean_norm_entropy: mean of ``norm_entropy``.
        mean_reuse_rate: the same share pooled over every layer (NaN if no call has a
            predecessor).
        working_set_mean: mean of ``working_set``.
        working_set_max: max of ``working_set``.
    """

    routed_layers: np.ndarray
    routes: np.ndarray
    norm_entropy: np.ndarray
    working_set: np.ndarray
    reuse_rate: np.ndarray
    mean_norm_entropy: float
    mean_reuse_rate: float
    working_set_mean: float
    working_set_max: int


def trace_statistics(trace: Trace) -> TraceStatistics:
    """Measure popularity skew, previous-token reuse and working set of a trace.

    "Previous token" is the previous call of the same layer in the same sequence, in call order
    (for a trace with missing records that is the nearest earlier token that reached the layer).
    Reuse counts distinct experts, ignores padding, and skips calls whose own or whose
    predecessor's routes are all padding.

    Args:
        trace: any trace.

    Returns:
        The statistics (float64 throughout; this is a report).

    Raises:
        ValueError: the trace has no non-padding route at all.
    """
    histogram = trace.routing_histogram()
    routes_per_layer = histogram.sum(axis=1)
    routed_layers = np.flatnonzero(routes_per_layer)
    if routed_layers.size == 0:
        raise ValueError(f"{trace.source}: no non-padding route, nothing to measure")
    counts = histogram[routed_layers].astype(np.float64)
    share = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(share > 0, share * np.log(share), 0.0)
    entropy = -plogp.sum(axis=1)
    experts = trace.num_experts
    norm_entropy = entropy / math.log(experts) if experts > 1 else np.zeros_like(entropy)
    working_set = (histogram[routed_layers] > 0).sum(axis=1).astype(np.int64)

    reused, considered = _reuse_counts(trace)
    with np.errstate(divide="ignore", invalid="ignore"):
        reuse_rate = reused[routed_layers] / considered[routed_layers]
    total = considered.sum()
    return TraceStatistics(
        routed_layers=routed_layers,
        routes=routes_per_layer[routed_layers],
        norm_entropy=norm_entropy,
        working_set=working_set,
        reuse_rate=reuse_rate,
        mean_norm_entropy=float(norm_entropy.mean()),
        mean_reuse_rate=float(reused.sum() / total) if total else math.nan,
        working_set_mean=float(working_set.mean()),
        working_set_max=int(working_set.max()),
    )


def _reuse_counts(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: (distinct experts also routed by the predecessor call, distinct experts).

    Only calls with a predecessor (same layer, same sequence) whose routes are not all padding
    are counted.
    """
    routes = np.sort(trace.routes, axis=1)
    distinct = routes >= 0
    distinct[:, 1:] &= routes[:, 1:] != routes[:, :-1]
    # Group calls by (sequence, layer), keeping call order inside a group (stable sort).
    order = np.lexsort((trace.layers, trace.sequence))
    current, previous = order[1:], order[:-1]
    same_group = ((trace.layers[current] == trace.layers[previous])
                  & (trace.sequence[current] == trace.sequence[previous]))
    current, previous = current[same_group], previous[same_group]
    previous_has_routes = distinct[previous].any(axis=1)
    current, previous = current[previous_has_routes], previous[previous_has_routes]

    cur = np.where(distinct[current], routes[current], -2)    # -2 never matches a route
    prev = np.where(distinct[previous], routes[previous], -3)
    also_previous = (cur[:, :, None] == prev[:, None, :]).any(axis=2)
    layer_of = trace.layers[current]
    reused = np.bincount(layer_of, weights=also_previous.sum(axis=1),
                         minlength=trace.num_layers)
    considered = np.bincount(layer_of, weights=distinct[current].sum(axis=1),
                             minlength=trace.num_layers)
    return reused, considered
