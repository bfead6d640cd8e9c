"""Routing from the engines people run, as trace arrays (docs/replay.md).

:func:`routes_from_router_logits` turns Hugging Face ``transformers`` router logits into the int32
``[tokens, layers, top_k]`` array a trace is built from, selecting as ``jax.lax.top_k`` does.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["routes_from_router_logits"]


def routes_from_router_logits(logits: Sequence[Any] | np.ndarray, top_k: int) -> np.ndarray:
    """The ``top_k`` experts each token's router picked, per layer.

    Args:
      logits: one ``[tokens, num_experts]`` array per MoE layer, in layer order (the
        ``router_logits`` tuple of a ``transformers`` MoE model's output; convert a tensor with
        ``.float().cpu().numpy()``), or one ``[layers, tokens, num_experts]`` array. Softmax is
        monotonic, so logits and router probabilities pick the same experts.
      top_k: experts routed per token (the model's ``num_experts_per_tok``).

    Returns:
      int32 ``[tokens, layers, top_k]``: for each token and layer the experts in descending
      logit order, ties broken towards the lower expert index, exactly as ``jax.lax.top_k``.

    Raises:
      TypeError: ``top_k`` is not an int, or the logits are not real numbers.
      ValueError: no layers, a layer that is not 2-D, layers whose shapes differ (both shapes
        named), ``top_k`` outside ``[1, num_experts]``, or a NaN logit.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    layers = [np.asarray(layer) for layer in logits]
    if not layers:
        raise ValueError("router logits: no layers")
    first = layers[0].shape
    for index, layer in enumerate(layers):
        if layer.ndim != 2:
            raise ValueError(f"router logits of layer {index}: expected [tokens, num_experts], "
                             f"got shape {layer.shape}")
        if layer.shape != first:
            raise ValueError(f"router logits of layer {index} have shape {layer.shape}, layer 0 "
                             f"has {first}: every layer must route the same tokens")
        if not (np.issubdtype(layer.dtype, np.floating) or np.issubdtype(layer.dtype, np.integer)):
            raise TypeError(f"router logits of layer {index}: expected real numbers, got "
                            f"dtype {layer.dtype}")
    num_experts = first[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} is outside [1, num_experts={num_experts}]")
    stacked = np.stack(layers, axis=1).astype(np.float64)  # [tokens, layers, E], exact widening
    if np.isnan(stacked).any():
        raise ValueError("router logits contain NaN")
    # A stable sort of the negated logits keeps equal logits in index order: the lower index
    # first, as jax.lax.top_k. (+0.0 and -0.0 tie here; they are not routing decisions anyone
    # makes on purpose.)
    order = np.argsort(-stacked, axis=-1, kind="stable")[..., :top_k]
    return order.astype(np.int32)
