"""Rough measurements of the two bandwidths of the cost model (docs/semantics.md §11.1).

``B_link`` from a ``jax.device_put`` of host memory, ``B_cpu`` from a one-token matrix-vector
product in NumPy; medians after a warm-up, printed as ``pallas-cache replay`` flags.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

__all__ = ["median_seconds", "link_bandwidth", "cpu_bandwidth"]


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
