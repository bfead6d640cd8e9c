"""Rough measurements of the two bandwidths of the cost model (docs/semantics.md §11.1).

``B_link``: a host-to-device ``jax.device_put`` of a block of host memory (pageable NumPy memory,
so a lower bound of what pinned buffers reach). ``B_cpu``: the expert bytes per second a
one-token matrix-vector product streams through on the CPU (float32 NumPy; a serving engine's own
kernels, quantized or not, stream at their own rate). Both are medians of a few timed runs after
a warm-up; they are a starting point for ``--link-bandwidth`` / ``--cpu-bandwidth``, to be
replaced by the serving engine's own numbers when those are known.
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
