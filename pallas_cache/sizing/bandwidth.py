"""Rough measurements of the cost model's inputs (docs/semantics.md §11.1).

``B_link`` from a ``jax.device_put`` of host memory, ``B_cpu`` from a one-token matrix-vector
product in NumPy, and ``T_cpu``, the CPU partial's fixed cost per layer-call, from the
library's :func:`~pallas_cache.hybrid.cpu_partial` against 1-4 CPU experts; medians after a
warm-up, printed as ``pallas-cache replay`` flags.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

__all__ = ["median_seconds", "link_bandwidth", "cpu_bandwidth", "cpu_fixed_cost"]


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``run`` after one warm-up call."""
    run()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def link_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5, device=None) -> float:
    """Bytes per second of ``jax.device_put`` from host memory to ``device`` (default: the
    first device of the default backend; on a CPU-only machine that is a host copy)."""
    import jax

    device = device if device is not None else jax.devices()[0]
    host = np.ones(int(num_bytes), np.uint8)
    return host.nbytes / median_seconds(
        lambda: jax.device_put(host, device).block_until_ready(), repeats)


def cpu_bandwidth(d_model: int = 4096, d_expert: int = 14336, repeats: int = 5) -> float:
    """Bytes per second of weights a one-token float32 ``x @ W`` streams (``W``: one expert
    matrix of ``d_model x d_expert``; the default is Mixtral-8x7B's, 224 MiB)."""
    weights = np.ones((int(d_model), int(d_expert)), np.float32)
    x = np.ones((1, int(d_model)), np.float32)
    return weights.nbytes / median_seconds(lambda: x @ weights, repeats)


def cpu_fixed_cost(d_model: int = 4096, d_expert: int = 14336, repeats: int = 5,
                   calls: int = 8) -> tuple[float, float]:
    """``(T_cpu, seconds per expert)``: the intercept and slope of a least-squares line through
    the median time of one layer-call's :func:`~pallas_cache.hybrid.cpu_partial` (one token,
    float32 ``x @ W`` experts of ``d_model x d_expert`` in a host bank) with 1, 2, 3 and 4
    distinct CPU experts. Each point: ``calls`` layer-calls in one compiled scan, median of
    ``repeats`` runs, divided by ``calls``. The intercept is what a call pays for having a CPU
    partial at all (the host region's launch and round trip); it is clamped at 0."""
    import jax
    import jax.numpy as jnp

    from pallas_cache.hybrid import cpu_partial
    from pallas_cache.moe import put_host_bank
    from pallas_cache.ops import ensure_hybrid
    from pallas_cache.policy import FetchPolicy
    from pallas_cache.state import init

    most = 4
    rng = np.random.default_rng(0)
    bank = put_host_bank((rng.standard_normal((most, int(d_model), int(d_expert)), np.float32)
                          / np.sqrt(d_model)).astype(np.float32))
    x = jnp.ones((int(d_model),), jnp.float32)
    gates = jnp.full((most,), 1.0 / most, jnp.float32)
    counts, seconds = [], []
    for count in range(1, most + 1):
        ids = jnp.asarray(list(range(count)) + [-1] * (most - count), jnp.int32)
        # A real plan: fraction 0 copies no miss, so every routed expert runs on the CPU.
        _, plan = ensure_hybrid(init(1, most, most), 0, ids, FetchPolicy.fraction(0.0))

        @jax.jit
        def loop(x, ids=ids, plan=plan):
            def body(h, _):
                y = cpu_partial(h, ids, gates, plan, bank, lambda w, t: t @ w)
                return h + 1e-6 * y.sum(), None  # a chain: no call is left out
            return jax.lax.scan(body, x, None, length=calls)[0]

        counts.append(count)
        seconds.append(median_seconds(lambda: loop(x).block_until_ready(), repeats) / calls)
    slope, intercept = np.polyfit(np.asarray(counts, float), np.asarray(seconds), 1)
    return max(float(intercept), 0.0), float(slope)
