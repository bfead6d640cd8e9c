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

A second family, :class:`RealisticParams` (presets ``mixtral-realistic`` and
``fine-grained-realistic``), adds what this model lacks: token identity. Tokens come from a Zipf
vocabulary with copied spans and each (token, layer) routes from a seeded embedding filtered over
recent tokens, so a past token whose routes match predicts the next layers
(:func:`neighbour_precision`) and repeats fade with lag (:func:`lag_repeat_probability`).
:func:`next_token_precision` measures how well the successor of the past token most like the
current one predicts the next token (how much the sequence repeats). Every statistic reads any
trace: the repeat statistics pair the calls of one layer within one sequence, the two precisions
read each sequence's complete tokens (:func:`complete_sequences`) and pool them by calls.

(Why one module of ~700 lines: both preset families and the statistics that calibrate them
(repeat probability, neighbour precision, skew) are read together when a preset is tuned; a
split into generators and statistics is a candidate once a third family arrives.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pallas_cache.host.metrics import histogram_metrics
from pallas_cache.sizing.traces import Trace, check_memory, resolve_memory_limit, trace_bytes
from pallas_cache.validate import is_int

__all__ = [
    "SyntheticParams",
    "PRESETS",
    "DEFAULT_PRESET_TOKENS",
    "synthetic_trace",
    "checked_params",
    "layer_exponents",
    "TraceStatistics",
    "trace_statistics",
    "RealisticParams",
    "realistic_token_ids",
    "lag_repeat_probability",
    "neighbour_precision",
    "next_token_precision",
    "complete_sequences",
    "per_layer_lru_hit_rate",
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
        if not _finite_number(self.skew_spread) or self.skew_spread < 0:
            raise ValueError(f"skew_spread must be a finite number >= 0, got "
                             f"{self.skew_spread!r}")
        if not _finite_number(self.reuse) or not 0.0 <= self.reuse <= 1.0:
            raise ValueError(f"reuse must be a probability in [0, 1], got {self.reuse!r}")


#: Named parameter sets. ``mixtral-like``: Mixtral-8x7B geometry, near-flat routers (measured
#: mean normalised entropy about 0.97) and previous-token reuse about 0.37. ``fine-grained``:
#: many small experts (DeepSeek/Qwen-MoE style geometry) with clearly skewed, layer-varying
#: popularity and weaker reuse.
PRESETS: dict[str, SyntheticParams | RealisticParams] = {
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


def checked_params(preset_or_params, num_tokens: int | None = None, seed: int = 0, *,
                   max_memory: int | None = None):
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
    if num_tokens is not None:
        params = replace(params, num_tokens=num_tokens)
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

    calls = params.num_tokens * params.num_layers
    check_memory(4 * calls * params.top_k + 2 * trace_bytes(calls, params.top_k),
                 resolve_memory_limit(max_memory), f"synthetic:{label}",
                 f"num_tokens={params.num_tokens} ({calls} calls x top_k {params.top_k})")
    return params, label


def synthetic_trace(preset_or_params: str | SyntheticParams | RealisticParams,
                    num_tokens: int | None = None, seed: int = 0, *,
                    max_memory: int | None = None) -> Trace:
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
    params, label = checked_params(preset_or_params, num_tokens, seed, max_memory=max_memory)
    if isinstance(params, RealisticParams):
        return Trace.from_dense(_realistic_routes(params, seed), num_layers=params.num_layers,
                                num_experts=params.num_experts,
                                source=f"synthetic:{label}(tokens={params.num_tokens}, "
                                       f"seed={seed})", max_memory=max_memory)
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

    # Large draws are vectorised (see _Gumbel); small ones cost less drawn by gumbel itself.
    vectorised = layers * experts >= _VECTOR_DRAWS_FROM and experts > top_k + 1
    keys = log_popularity + rng.gumbel(size=(layers, experts))
    previous = np.sort(np.argsort(-keys, axis=1)[:, :top_k], axis=1)
    out[0] = previous
    for token in range(1, params.num_tokens):
        shape = (layers, experts)
        noise = _Gumbel(rng, shape) if vectorised else rng.gumbel(size=shape)
        keep = rng.random((layers, top_k)) < params.reuse

        def keys_of(noise_values):
            keys = log_popularity + noise_values
            keys[layer_rows, previous] = np.where(keep, -np.inf,
                                                  keys[layer_rows, previous] - dropped_penalty)
            return keys

        if not vectorised:
            fresh = np.argsort(-keys_of(noise), axis=1)[:, :top_k]
        else:
            fresh = _clear_top_ranks(keys_of(noise.fast), top_k, layer_rows)
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
_GUMBEL_MARGIN = 1e-12
#: Draws per token from which :class:`_Gumbel` vectorises them (measured: with 32 x 8 draws per
#: token the generator ran slower vectorised, with 48 x 128 it took two thirds of the time).
_VECTOR_DRAWS_FROM = 1024


class _Gumbel:
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


def _clear_top_ranks(keys: np.ndarray, top_k: int, rows: np.ndarray) -> np.ndarray | None:
    """``np.argsort(-keys, axis=1)[:, :top_k]``, or None when it is not decided by clear margins:
    when some row's ``top_k + 1`` best keys are not apart by at least :data:`_GUMBEL_MARGIN`
    ``* (1 + |key|)`` (ties and ``-inf`` neighbours included). With clear margins the first
    ``top_k`` ranks are the same for noise that differs by a few ulp, and a partial sort finds
    them (about half the time of the full one at 128 experts). ``rows``: ``arange(L)[:, None]``;
    needs more than ``top_k + 1`` keys per row."""
    best = np.argpartition(-keys, top_k, axis=1)[:, :top_k + 1]
    best = best[rows, np.argsort(-keys[rows, best], axis=1)]  # the top_k + 1, best first
    top = keys[rows, best]
    with np.errstate(invalid="ignore"):
        gap = top[:, :-1] - top[:, 1:]
        if not np.all(gap >= _GUMBEL_MARGIN * (1.0 + np.abs(top[:, :-1]))):
            return None
    return best[:, :top_k]


# ---- the token-structured ("realistic") family ------------------------------------------------


#: The context filter of the realistic presets: the token itself and a weak, fading echo of the
#: two previous tokens. With the copied spans and the vocabulary's repeats it gives the repeat
#: profile measured on Mixtral-8x7B decode traces: 0.34-0.41 at lag 1, falling monotonically to
#: about 0.27-0.28 by lag 4-8 (chance 0.25 on 2-of-8), with no dip below chance.
_REALISTIC_CONTEXT = (1.0, 0.3, 0.15)


@dataclass(frozen=True)
class RealisticParams:
    """The knobs of the token-structured generator (see :func:`synthetic_trace`).

    The defaults are ``mixtral-realistic``'s calibrated values; vary one with
    ``dataclasses.replace(PRESETS["mixtral-realistic"], copy_prob=0.0)``.

    The model, per decode token ``t`` (``K = top_k``):

    1. **Token identity.** ``tok[t]`` is drawn from a vocabulary of ``vocab_size`` ids with Zipf
       frequencies ``p[rank] ~ 1 / rank**vocab_zipf``, except inside *copied spans*: each token
       starts a span with probability ``copy_prob`` (length geometric with mean ``copy_span``)
       that repeats the tokens found ``d`` positions back (``d`` uniform in
       ``[1, min(copy_window, t)]``), as text repeats names, phrases and code.
    2. **Hidden state.** Each vocabulary id has a seeded embedding ``U[v]`` (``embed_dim``
       Gaussian, unit expected norm); the router input of token ``t`` is the causal filter
       ``h[t] = sum_k context[k] * U[tok[t - k]]`` (tokens before the trace contribute nothing),
       so ``context[0]`` weighs the token itself and later taps its recent context (a negative
       tap makes the routes of tokens that far back *less* likely than chance).
    3. **Routing.** Layer ``l`` routes the ``K`` largest of
       ``(h[t] + layer_noise * n[t, l]) @ W[l] + b[l]``, with ``W[l]`` a seeded
       Gaussian ``[embed_dim, E]`` router, ``n`` fresh Gaussian noise per (token, layer) and
       ``b[l]`` the Zipf popularity bias of the other family (``skew``, ``skew_spread``; ``0`` =
       none). Routes are shared across layers only through ``h``: a past token whose routes at
       the layers so far match the current token's tends to carry the same ``h`` (the same
       token, or the same token in the same context), so it predicts the next layers.

    Everything is vectorised over tokens; random draws come from independent per-quantity
    streams consumed in token order, so a longer trace from the same seed extends a shorter one.

    Attributes:
        num_layers, num_experts, top_k, num_tokens: geometry, as in :class:`SyntheticParams`.
        vocab_size: ``V`` vocabulary ids (``>= 1``).
        vocab_zipf: Zipf exponent of the vocabulary frequencies (``>= 0``).
        copy_prob: per-token probability of starting a copied span, in ``[0, 1]``.
        copy_span: mean length of a copied span (``>= 1``).
        copy_window: the furthest back (in tokens) a copied span's source starts (``>= 1``).
        context: filter taps ``context[k]`` on the embedding of token ``t - k`` (finite, at least
            one).
        layer_noise: scale of the per-(token, layer) noise relative to a unit embedding (``>= 0``).
        embed_dim: embedding width (``>= 1``).
        skew: Zipf exponent of the per-layer router bias (scalar, ``>= 0``).
        skew_spread: its variation across layers, as in :class:`SyntheticParams`.
    """

    num_layers: int
    num_experts: int
    top_k: int
    num_tokens: int = DEFAULT_PRESET_TOKENS
    vocab_size: int = 8192
    vocab_zipf: float = 0.9
    copy_prob: float = 0.05
    copy_span: float = 48.0
    copy_window: int = 128
    context: tuple[float, ...] = _REALISTIC_CONTEXT
    layer_noise: float = 0.37
    embed_dim: int = 16
    skew: float = 0.0
    skew_spread: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "num_tokens", "vocab_size",
                     "copy_window", "embed_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a "
                             f"call routes distinct experts")
        for name, low in (("vocab_zipf", 0.0), ("layer_noise", 0.0), ("skew", 0.0),
                          ("skew_spread", 0.0), ("copy_span", 1.0)):
            value = getattr(self, name)
            if not _finite_number(value) or value < low:
                raise ValueError(f"{name} must be a finite number >= {low:g}, got {value!r}")
        if not _finite_number(self.copy_prob) or not 0.0 <= self.copy_prob <= 1.0:
            raise ValueError(f"copy_prob must be a probability in [0, 1], got {self.copy_prob!r}")
        try:
            taps = tuple(float(c) for c in self.context)
        except TypeError:
            raise ValueError(f"context must be a sequence of filter taps, got "
                             f"{self.context!r}") from None
        if not taps or not all(math.isfinite(c) for c in taps):
            raise ValueError(f"context must be a non-empty sequence of finite taps, got "
                             f"{self.context!r}")
        object.__setattr__(self, "context", taps)


#: The token-structured presets (``benchmarks/realistic_preset.py`` prints their statistics next
#: to the measured Mixtral-8x7B ones). ``mixtral-realistic``: Mixtral-8x7B geometry calibrated
#: against two real decode traces (HumanEval and GSM8K prompts: lag 1-8 repeats, neighbour and
#: next-token precision, normalised entropy, LRU / per-layer LRU / Belady hit rates at 2-6 slots
#: per layer; docs/policies.md). ``fine-grained-realistic``: the same token model on the
#: fine-grained geometry, with a skewed router bias.
PRESETS["mixtral-realistic"] = RealisticParams(num_layers=32, num_experts=8, top_k=2)
PRESETS["fine-grained-realistic"] = RealisticParams(num_layers=48, num_experts=128, top_k=8,
                                                    skew=0.4, skew_spread=0.4)


#: Tokens per vectorised block of the router draw: bounds the float32 logits held at once
#: (``block * L * E``: 25 MB for 48 x 128) without changing any value.
_REALISTIC_BLOCK = 1024


def _realistic_stream(seed: int, name: str) -> np.random.Generator:
    """An independent generator per quantity, so each is drawn in token order on its own."""
    return np.random.default_rng([seed, _STREAM_IDS[name]])


_STREAM_IDS = {"model": 1, "vocab": 2, "copy": 3, "noise": 4}


def realistic_token_ids(params: RealisticParams, seed: int = 0) -> np.ndarray:
    """The vocabulary id of every token of the realistic trace for ``params`` and ``seed``.

    Returns:
        int32 ``[num_tokens]``; ids are frequency ranks (``0`` = the most frequent).
    """
    tokens = params.num_tokens
    weights = np.arange(1, params.vocab_size + 1, dtype=np.float64) ** -params.vocab_zipf
    cdf = np.cumsum(weights)
    fresh = np.searchsorted(cdf, _realistic_stream(seed, "vocab").random(tokens) * cdf[-1],
                            side="right")
    fresh = np.minimum(fresh, params.vocab_size - 1).astype(np.int32)

    draws = _realistic_stream(seed, "copy").random((tokens, 3))
    position = np.arange(tokens)
    starts = draws[:, 0] < params.copy_prob
    starts[0] = False  # nothing to copy yet
    back = 1 + np.floor(draws[:, 1] * np.minimum(params.copy_window, position)).astype(np.int64)
    if params.copy_span > 1.0:
        length = 1 + np.floor(np.log1p(-draws[:, 2]) / math.log1p(-1.0 / params.copy_span))
    else:
        length = np.ones(tokens)
    last_start = np.maximum.accumulate(np.where(starts, position, -1))
    span = np.maximum(last_start, 0)
    copied = (last_start >= 0) & (position < last_start + length[span])
    source = np.where(copied, position - back[span], position)
    while True:  # pointer jumping: a copy of a copy resolves to the fresh token it repeats
        deeper = source[source]
        if np.array_equal(deeper, source):
            break
        source = deeper
    return fresh[source]


def _realistic_routes(params: RealisticParams, seed: int) -> np.ndarray:
    """Draw ``[tokens, layers, top_k]`` int16 routes (see :class:`RealisticParams`)."""
    layers, experts, top_k, dim = (params.num_layers, params.num_experts, params.top_k,
                                   params.embed_dim)
    model = _realistic_stream(seed, "model")
    _, bias = _layer_popularity(params, model)
    embedding = model.standard_normal((params.vocab_size, dim)).astype(np.float32)
    embedding /= np.float32(math.sqrt(dim))
    router = model.standard_normal((layers, dim, experts)).astype(np.float32)
    bias = bias.astype(np.float32)

    ids = realistic_token_ids(params, seed)
    hidden = np.zeros((params.num_tokens, dim), dtype=np.float32)
    for lag, tap in enumerate(params.context):
        if tap and lag < params.num_tokens:
            hidden[lag:] += np.float32(tap) * embedding[ids[: params.num_tokens - lag]]

    noise = _realistic_stream(seed, "noise")
    noise_scale = np.float32(params.layer_noise / math.sqrt(dim))
    out = np.empty((params.num_tokens, layers, top_k),
                   dtype=np.int16 if experts <= np.iinfo(np.int16).max else np.int32)
    for start in range(0, params.num_tokens, _REALISTIC_BLOCK):
        stop = min(start + _REALISTIC_BLOCK, params.num_tokens)
        x = noise.standard_normal((stop - start, layers, dim), dtype=np.float32)
        x *= noise_scale
        x += hidden[start:stop, None, :]
        # numpy's own einsum loop, not BLAS: a multithreaded sgemm on a busy machine is ~40x
        # slower for these thin [n, 16] x [16, E] products, and its rounding may vary by thread.
        logits = np.einsum("nld,lde->lne", x, router)               # [L, n, E]
        logits += bias[:, None, :]
        if top_k < experts:
            top = np.argpartition(logits, experts - top_k, axis=2)[:, :, experts - top_k:]
        else:
            top = np.broadcast_to(np.arange(experts), logits.shape)
        out[start:stop] = np.sort(top, axis=2).transpose(1, 0, 2)
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
    metrics = histogram_metrics(histogram[routed_layers])
    norm_entropy, working_set = metrics.norm_entropy, metrics.working_set

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


def lag_repeat_probability(trace: Trace, max_lag: int = 8) -> np.ndarray:
    """How often a layer routes again an expert it routed ``k`` of its calls earlier.

    For each lag ``k`` in ``1..max_lag``: over every call that has a ``k``-th previous call of
    the same layer in the same sequence (in call order) whose routes are not all padding, the
    share of the call's distinct experts that the earlier call also routed (pooled over layers:
    the sum of matches over the sum of distinct experts). On a uniform top-``K`` router with no
    memory it is ``K / E`` at every lag (0.25 on Mixtral's 2-of-8); lag 1 equals
    :func:`trace_statistics`'s ``mean_reuse_rate``.

    Args:
        trace: any trace.
        max_lag: the largest lag (``>= 1``).

    Returns:
        float64 ``[max_lag]``; entry ``k - 1`` is lag ``k`` (NaN where no call has such a
        predecessor).
    """
    if not isinstance(max_lag, (int, np.integer)) or isinstance(max_lag, bool) or max_lag < 1:
        raise ValueError(f"max_lag must be a positive integer, got {max_lag!r}")
    routes = np.sort(trace.routes, axis=1)
    distinct = routes >= 0
    distinct[:, 1:] &= routes[:, 1:] != routes[:, :-1]
    order = np.lexsort((trace.layers, trace.sequence))   # group by (sequence, layer), call order
    group = trace.sequence[order].astype(np.int64) * trace.num_layers + trace.layers[order]
    has_routes = distinct.any(axis=1)
    out = np.full(max_lag, np.nan)
    for lag in range(1, max_lag + 1):
        current, earlier = order[lag:], order[:-lag]
        keep = (group[lag:] == group[:-lag]) & has_routes[earlier]
        current, earlier = current[keep], earlier[keep]
        cur = np.where(distinct[current], routes[current], -2)    # -2 never matches a route
        prev = np.where(distinct[earlier], routes[earlier], -3)
        matched = (cur[:, :, None] == prev[:, None, :]).any(axis=2).sum()
        considered = distinct[current].sum()
        if considered:
            out[lag - 1] = matched / considered
    return out


def _pooled_precision(trace: Trace, counts, window, block: int) -> float:
    """``sum(matched) / sum(predicted)`` of ``counts(dense, E, window, block)`` over the trace's
    complete sequences (NaN when none predicts anything)."""
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    matched = predicted = 0
    for dense in complete_sequences(trace):
        hits, size = counts(dense, trace.num_experts, window, block)
        matched, predicted = matched + hits, predicted + size
    return matched / predicted if predicted else math.nan


def neighbour_precision(trace: Trace, window: int = 128, *, block: int = 256) -> float:
    """How well the past token whose routes best match the current token's predicts the next layer.

    Per sequence, over its complete tokens ``R[t, l]`` (:func:`complete_sequences`: sets of
    distinct routed experts) and every token ``t >= 1`` and layer ``l >= 1``: among the past
    tokens ``j`` in ``[max(0, t - window), t - 1]`` of the same sequence take the one with the
    most matching routes over the layers so far, ``match(j) = sum_{m < l} |R[t, m] & R[j, m]|``,
    ties to the most recent ``j``; its precision is ``|R[j, l] & R[t, l]| / |R[j, l]|`` -- the
    share of the neighbour's layer-``l`` experts the current token routes too. The result pools
    the matches over the predictions of every sequence (``sum |R[j, l] & R[t, l]| / sum
    |R[j, l]|``). Layer 0 (no evidence yet) and a sequence's first token (no past) are not
    counted. A router with no memory scores ``K / E``.

    Args:
        trace: any trace; tokens that do not call every layer are dropped (see
            :func:`complete_sequences`).
        window: how many past tokens are candidates (``>= 1``).
        block: tokens processed at once (memory ``block * window * L``; the value is unchanged).

    Returns:
        The pooled precision (NaN when no sequence has two complete tokens, or ``L == 1``).
    """
    return _pooled_precision(trace, _neighbour_counts, window, block)


def _neighbour_counts(dense: np.ndarray, num_experts: int, window: int, block: int
                      ) -> tuple[int, int]:
    """(matched, predicted) of :func:`neighbour_precision` over one dense sequence."""
    tokens, layers, _ = dense.shape
    if tokens < 2 or layers < 2:
        return 0, 0
    masks = _route_masks(dense, num_experts)                    # [T, L, W] uint64
    sizes = np.bitwise_count(masks).sum(axis=2, dtype=np.int64)  # [T, L]
    lags = np.arange(1, window + 1)
    matched = predicted = 0
    for start in range(1, tokens, block):
        now = np.arange(start, min(start + block, tokens))
        past = now[:, None] - lags[None, :]                      # [n, window], most recent first
        valid = past >= 0
        past = np.maximum(past, 0)
        overlap = np.bitwise_count(masks[now][:, None] & masks[past]).sum(
            axis=3, dtype=np.int32)                               # [n, window, L]
        so_far = np.cumsum(overlap, axis=2) - overlap              # matches over layers < l
        so_far = np.where(valid[:, :, None], so_far, -1)
        best = np.argmax(so_far, axis=1)                           # [n, L]: first = most recent
        hits = np.take_along_axis(overlap, best[:, None, :], axis=1)[:, 0, :]
        neighbour = np.take_along_axis(past, best, axis=1)        # [n, L]
        size = sizes[neighbour, np.arange(layers)[None, :]]
        matched += int(hits[:, 1:].sum())
        predicted += int(size[:, 1:].sum())
    return matched, predicted


def next_token_precision(trace: Trace, window: int = 128, *, block: int = 256) -> float:
    """How well the successor of the past token most like the current one predicts the next token.

    Per sequence, over its ``N`` complete tokens ``R[t, l]`` (:func:`complete_sequences`: sets
    of distinct routed experts) and every token ``T`` with ``1 <= T <= N - 2``: at the end of
    ``T`` (only tokens up to ``T`` are read), take the past token ``j`` in ``[max(0, T -
    window), T - 1]`` of the same sequence with the most matching routes over *all* layers,
    ``match(j) = sum_l |R[T, l] & R[j, l]|``, ties to the most recent ``j`` (so ``j = T - 1``,
    whose successor is ``T`` itself, is a candidate). Its successor predicts the next token: the
    result pools ``sum_l |R[j + 1, l] & R[T + 1, l]|`` over ``sum_l |R[j + 1, l]|``, summed over
    the sequences. A router with no memory scores ``K / E``; always taking ``j = T - 1`` scores
    the lag-1 reuse.

    This is the statistic that decides how much a token-similarity eviction (``ROUTE_KNN``)
    gains over LRU at two slots per layer (``benchmarks/RESULTS.md``, ``preset_sensitivity``):
    measured on real Mixtral-8x7B decode traces it is 0.49-0.59 (docs/policies.md), and
    ``mixtral-realistic`` is calibrated into that range. Measure it on your own trace
    (``benchmarks/realistic_preset.py --trace PATH``) to tell which regime your traffic is in.

    Args:
        trace: any trace; tokens that do not call every layer are dropped (see
            :func:`complete_sequences`).
        window: how many past tokens are candidates (``>= 1``).
        block: tokens processed at once (memory ``block * window * L``; the value is unchanged).

    Returns:
        The pooled precision (NaN when no sequence has three complete tokens).
    """
    return _pooled_precision(trace, _next_token_counts, window, block)


def _next_token_counts(dense: np.ndarray, num_experts: int, window: int, block: int
                       ) -> tuple[int, int]:
    """(matched, predicted) of :func:`next_token_precision` over one dense sequence."""
    tokens = dense.shape[0]
    if tokens < 3:
        return 0, 0
    masks = _route_masks(dense, num_experts)              # [T, L, W] uint64
    sizes = np.bitwise_count(masks).sum(axis=(1, 2), dtype=np.int64)  # [T] routes per token
    lags = np.arange(1, window + 1)
    matched = predicted = 0
    for start in range(1, tokens - 1, block):
        now = np.arange(start, min(start + block, tokens - 1))  # T with T + 1 < N
        past = now[:, None] - lags[None, :]                      # [n, window], most recent first
        valid = past >= 0
        past = np.maximum(past, 0)
        match = np.bitwise_count(masks[now][:, None] & masks[past]).sum(
            axis=(2, 3), dtype=np.int64)                          # [n, window]
        best = past[np.arange(now.size), np.argmax(np.where(valid, match, -1), axis=1)]
        matched += int(np.bitwise_count(masks[best + 1] & masks[now + 1]).sum(dtype=np.int64))
        predicted += int(sizes[best + 1].sum())
    return matched, predicted


def _route_masks(dense: np.ndarray, num_experts: int) -> np.ndarray:
    """``[T, L, K]`` routes (-1 = padding) -> ``[T, L, ceil(E / 64)]`` uint64 expert bitmasks."""
    words = -(-num_experts // 64)
    tokens, layers, _ = dense.shape
    masks = np.zeros((tokens, layers, words), dtype=np.uint64)
    for k in range(dense.shape[2]):
        expert = dense[:, :, k].astype(np.int64)
        routed = expert >= 0
        safe = np.where(routed, expert, 0)
        bit = np.where(routed, np.left_shift(np.uint64(1), (safe % 64).astype(np.uint64)),
                       np.uint64(0))
        for word in range(words):
            masks[:, :, word] |= np.where(safe // 64 == word, bit, np.uint64(0))
    return masks


def complete_sequences(trace: Trace) -> list[np.ndarray]:
    """Each sequence's complete tokens as one dense ``[tokens, layers, top_k]`` array.

    A token (a ``(sequence, token_idx)`` pair) is *complete* when its calls, in call order, are
    layers ``0..L-1`` once each; other tokens are dropped -- typically a request's last tokens
    in a JSONL trace, which stop before the last layers. A sequence's complete tokens keep
    ascending ``token_idx`` order, so a dropped token's neighbours become adjacent. A dense
    trace gives ``[trace.to_dense()]``.

    Args:
        trace: any trace.

    Returns:
        One int32 array per sequence with at least one complete token, in sequence order.
    """
    layers = trace.num_layers
    pairs = np.stack([trace.sequence.astype(np.int64), trace.token_idx], axis=1)
    _, token_of = np.unique(pairs, axis=0, return_inverse=True)  # sorted by (sequence, token_idx)
    token_of = token_of.reshape(-1)
    order = np.argsort(token_of, kind="stable")                  # by token, call order inside
    counts = np.bincount(token_of)
    starts = np.cumsum(counts) - counts
    position = np.arange(trace.num_calls) - np.repeat(starts, counts)
    out_of_place = np.bincount(token_of[order], weights=trace.layers[order] != position,
                               minlength=counts.size)
    complete = (counts == layers) & (out_of_place == 0)
    keep = complete[token_of[order]]
    calls = order[keep]                                          # complete tokens' calls, layer order
    routes = trace.routes[calls].reshape(-1, layers, trace.top_k)
    sequence_of = trace.sequence[calls[::layers]]
    bounds = np.flatnonzero(np.diff(sequence_of)) + 1
    return [np.ascontiguousarray(part) for part in np.split(routes, bounds) if part.size]


def per_layer_lru_hit_rate(trace: Trace, cache_size: int) -> float:
    """Hit rate of per-layer LRU with ``cache_size // L`` slots per layer over ``trace``.

    Per-layer LRU is the policy of mixtral-offloading: each of the ``L`` layers owns ``S / L``
    slots and keeps the most recently used experts of that layer in them. A call to layer ``l``
    with distinct experts ``D`` hits the experts of ``D`` that are resident; then every expert
    of ``D`` becomes resident with last use = this call, and while the layer holds more than its
    ``S / L`` slots it evicts its least recently used resident, ties (experts of one earlier
    call) to the lowest expert id. Counting matches the cache's stats: distinct experts per
    call, ``-1`` padding ignored. Like the replay, it runs over every call of the trace in call
    order with one cache: a new sequence starts with the previous one's residents, and a token
    that misses some layers simply does not touch them (every call is counted).

    Vectorised over layers: step ``i`` plays the ``i``-th call of every layer.

    Raises:
        ValueError: ``cache_size // L`` is below the trace's ``top_k`` (a call would evict its
            own experts).
    """
    layers, experts = trace.num_layers, trace.num_experts
    per_layer = cache_size // layers
    if per_layer < trace.top_k:
        raise ValueError(f"cache_size {cache_size} gives {per_layer} slots per layer for "
                         f"{layers} layers, fewer than top_k={trace.top_k}")
    order = np.argsort(trace.layers, kind="stable")              # by layer, call order inside
    counts = np.bincount(trace.layers, minlength=layers)
    rank = np.arange(trace.num_calls) - np.repeat(np.cumsum(counts) - counts, counts)
    schedule = np.full((int(counts.max()), layers), -1, dtype=np.int64)  # [step, L] call index
    schedule[rank, trace.layers[order]] = order
    rows = np.arange(layers)[:, None]
    # key = last use * E + expert for residents, -1 otherwise: the largest `per_layer` keys stay
    # (a later use wins; among one call's experts the higher id stays, the lower is evicted).
    key = np.full((layers, experts), -1, dtype=np.int64)
    hits = active = 0
    expert_ids = np.arange(experts, dtype=np.int64)[None, :]
    for call in schedule:
        route = np.where(call[:, None] >= 0, trace.routes[np.maximum(call, 0)], -1)
        routed = route >= 0
        safe = np.where(routed, route, 0)
        used = np.zeros((layers, experts), dtype=bool)
        used[np.broadcast_to(rows, route.shape)[routed], safe[routed]] = True
        hits += int(((key >= 0) & used).sum())
        active += int(used.sum())
        key = np.where(used, call[:, None] * experts + expert_ids, key)
        if per_layer < experts:
            kth = np.partition(key, experts - per_layer, axis=1)[:, experts - per_layer]
            key = np.where(key >= kth[:, None], key, -1)
    return hits / active if active else 1.0
