"""The Zipf-popularity and temporal-reuse generator (:class:`SyntheticParams`), drawn by
Gumbel-top-k."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pallas_cache.validate import is_int

__all__ = ["DEFAULT_PRESET_TOKENS", "SyntheticParams", "layer_exponents", "layer_popularity",
           "zipf_reuse_routes", "GUMBEL_MARGIN", "GumbelDraws", "clear_top_ranks",
           "finite_number"]

#: Token count a preset generates when ``num_tokens`` is not given: long enough for stable
#: statistics (about 1k routes per layer on mixtral-like, 4k on fine-grained), short enough that a
#: CLI replay of a 48-layer preset finishes in seconds on a laptop CPU.
DEFAULT_PRESET_TOKENS = 512


def finite_number(value: object) -> bool:
    """Whether ``value`` is a finite real number (a ``bool`` is not one)."""
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, bool) and math.isfinite(float(value)))


def _check_exponent(value: float, name: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite Zipf exponent >= 0, got {value!r}")


@dataclass(frozen=True)
class SyntheticParams:
    """The knobs of the Zipf-popularity and reuse generator.

    Each layer gets a Zipf popularity ``p[rank] ~ 1 / rank**s`` over a seeded random permutation
    of its experts (so the hot experts differ per layer), with exponent ``s`` per layer. Per
    token ``t`` and layer ``l`` (``K = top_k``, experts within one call are distinct):

    1. each of the previous token's ``K`` experts at ``l`` is kept independently with
       probability ``reuse``;
    2. the remaining ``K - kept`` experts are drawn without replacement, proportionally to the
       layer's popularity, from the experts the previous token did **not** route (when
       ``E < 2K`` there may be too few; the draw then falls back to the previous token's dropped
       experts).

    So ``reuse`` is exactly the expected previous-token reuse rate that
    :func:`~pallas_cache.sizing.trace_stats.trace_statistics` measures, and the realised
    popularity is mildly flatter than ``p``.

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
            if not is_int(value) or value < 1:
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
        if not finite_number(self.skew_spread) or self.skew_spread < 0:
            raise ValueError(f"skew_spread must be a finite number >= 0, got "
                             f"{self.skew_spread!r}")
        if not finite_number(self.reuse) or not 0.0 <= self.reuse <= 1.0:
            raise ValueError(f"reuse must be a probability in [0, 1], got {self.reuse!r}")


def layer_exponents(params: SyntheticParams, seed: int = 0) -> np.ndarray:
    """The Zipf exponent each layer uses for ``params`` and ``seed``.

    Args:
        params: generator knobs.
        seed: the same seed :func:`synthetic_trace` is given.

    Returns:
        float64 ``[num_layers]``.
    """
    return layer_popularity(params, np.random.default_rng(seed))[0]


def layer_popularity(params: SyntheticParams, rng: np.random.Generator
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


def zipf_reuse_routes(params: SyntheticParams, log_popularity: np.ndarray,
                      rng: np.random.Generator) -> np.ndarray:
    """Draw ``[tokens, layers, top_k]`` routes (the model of :class:`SyntheticParams`)."""
    layers, experts, top_k = params.num_layers, params.num_experts, params.top_k
    layer_rows = np.arange(layers)[:, None]
    columns = np.arange(top_k)[None, :]
    # A dropped previous expert ranks below every other candidate but above the kept ones; it is
    # only reached when fewer than K - kept non-previous experts exist (E < 2K).
    dropped_penalty = 1e9 + 4.0 * float(np.abs(log_popularity).max())
    out = np.empty((params.num_tokens, layers, top_k), dtype=np.int32)

    # Large draws are vectorised (see GumbelDraws); small ones cost less drawn by gumbel itself.
    vectorised = layers * experts >= _VECTOR_DRAWS_FROM and experts > top_k + 1
    keys = log_popularity + rng.gumbel(size=(layers, experts))
    previous = np.sort(np.argsort(-keys, axis=1)[:, :top_k], axis=1)
    out[0] = previous
    for token in range(1, params.num_tokens):
        shape = (layers, experts)
        noise = GumbelDraws(rng, shape) if vectorised else rng.gumbel(size=shape)
        keep = rng.random((layers, top_k)) < params.reuse

        def keys_of(noise_values):
            keys = log_popularity + noise_values
            keys[layer_rows, previous] = np.where(keep, -np.inf,
                                                  keys[layer_rows, previous] - dropped_penalty)
            return keys

        if not vectorised:
            fresh = np.argsort(-keys_of(noise), axis=1)[:, :top_k]
        else:
            fresh = clear_top_ranks(keys_of(noise.fast), top_k, layer_rows)
            if fresh is None:  # a near-tie the vectorised draws cannot decide: the exact ones do
                fresh = np.argsort(-keys_of(noise.exact()), axis=1)[:, :top_k]
        kept_count = keep.sum(axis=1, keepdims=True)
        take_fresh = columns < top_k - kept_count
        # Row-major boolean selection yields, per layer, its kept experts then its fresh ones:
        # exactly K per layer, so the reshape is exact.
        chosen = np.concatenate([previous, fresh], axis=1)[np.concatenate([keep, take_fresh],
                                                                          axis=1)]
        previous = np.sort(chosen.reshape(layers, top_k), axis=1)
        out[token] = previous
    return out


#: Smallest gap, relative to ``1 + |key|``, between neighbouring ranked keys that vectorised
#: Gumbel draws may decide. NumPy's SIMD ``log`` and the C library's (what ``Generator.gumbel``
#: calls) differ by at most a few ulp (measured: 0.4% of draws differ, by at most 9e-16), and a
#: key adds one rounding at its own magnitude (the dropped-expert penalty makes keys of about
#: 1e9); gaps above this margin are ordered the same by both.
GUMBEL_MARGIN = 1e-12
#: Draws per token from which :class:`GumbelDraws` vectorises them (measured: with 32 x 8 draws per
#: token the generator ran slower vectorised, with 48 x 128 it took two thirds of the time).
_VECTOR_DRAWS_FROM = 1024


class GumbelDraws:
    """``rng.gumbel(size=shape)``'s draws, consuming the same stream: ``fast`` computes them with
    NumPy's vectorised ``log`` (equal to the last few bits), :meth:`exact` bit for bit.

    ``Generator.gumbel`` computes ``-log(-log(1 - u))`` per element with the C library's ``log``
    from the next ``u = random()`` that is not 0 (a 0 is skipped), which costs about three
    quarters of generating a fine-grained trace; ``random`` plus two vectorised logs take a
    fraction of that.
    """

    def __init__(self, rng: np.random.Generator, shape: tuple[int, ...]):
        size = math.prod(shape)
        raw = rng.random(size)
        while not raw.all():  # gumbel skips a 0 and takes the next draw: so do the u's
            kept = raw[raw != 0.0]
            raw = np.concatenate([kept, rng.random(size - kept.size)])
        self._u = (1.0 - raw).reshape(shape)
        self.fast = -np.log(-np.log(self._u))
        self._exact = None

    def exact(self) -> np.ndarray:
        """The draws bit for bit as ``rng.gumbel`` makes them (Python's ``math.log`` is the C
        library's)."""
        if self._exact is None:
            self._exact = np.array([-math.log(-math.log(u)) for u in self._u.ravel().tolist()]
                                   ).reshape(self._u.shape)
        return self._exact


def clear_top_ranks(keys: np.ndarray, top_k: int, rows: np.ndarray) -> np.ndarray | None:
    """``np.argsort(-keys, axis=1)[:, :top_k]``, or None when it is not decided by clear margins:
    when some row's ``top_k + 1`` best keys are not apart by at least :data:`GUMBEL_MARGIN`
    ``* (1 + |key|)`` (ties and ``-inf`` neighbours included). With clear margins the first
    ``top_k`` ranks are the same for noise that differs by a few ulp, and a partial sort finds
    them (about half the time of the full one at 128 experts). ``rows``: ``arange(L)[:, None]``;
    needs more than ``top_k + 1`` keys per row."""
    best = np.argpartition(-keys, top_k, axis=1)[:, :top_k + 1]
    best = best[rows, np.argsort(-keys[rows, best], axis=1)]  # the top_k + 1, best first
    top = keys[rows, best]
    with np.errstate(invalid="ignore"):
        gap = top[:, :-1] - top[:, 1:]
        if not np.all(gap >= GUMBEL_MARGIN * (1.0 + np.abs(top[:, :-1]))):
            return None
    return best[:, :top_k]
