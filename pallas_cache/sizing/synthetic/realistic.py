"""The token-structured generator (:class:`RealisticParams`): a Zipf vocabulary with copied spans,
routed through seeded embeddings filtered over recent tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pallas_cache.sizing.synthetic.zipf_reuse import (DEFAULT_PRESET_TOKENS, finite_number,
                                                      layer_popularity)

__all__ = ["RealisticParams", "realistic_token_ids", "realistic_routes"]

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
            if not finite_number(value) or value < low:
                raise ValueError(f"{name} must be a finite number >= {low:g}, got {value!r}")
        if not finite_number(self.copy_prob) or not 0.0 <= self.copy_prob <= 1.0:
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


def realistic_routes(params: RealisticParams, seed: int) -> np.ndarray:
    """Draw ``[tokens, layers, top_k]`` int16 routes (see :class:`RealisticParams`)."""
    layers, experts, top_k, dim = (params.num_layers, params.num_experts, params.top_k,
                                   params.embed_dim)
    model = _realistic_stream(seed, "model")
    _, bias = layer_popularity(params, model)
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
