"""``benchmarks/hybrid_vmap.py``: the programs it times are the hybrid layer's, with the bank an
argument, not a constant rebuilt on every call."""

from __future__ import annotations

import pytest

from tests.core.bank_reads import whole_matrix_ops

SCRIPT = "hybrid_vmap"


@pytest.mark.usefixtures("optimized_xla")
def test_the_vmap_benchmark_times_the_layer_not_a_rebuilt_bank(script):
    """FAILS if benchmarks/hybrid_vmap.py closes its layer over the bank: jax <= 0.11 then makes
    the bank a constant of the program, which XLA:CPU rebuilds on every call (an op the size of
    the bank in both programs), so the benchmark times that rebuild and 4 caches look cheaper than
    one; on jax 0.12 the closed-over bank is an argument and this passes either way."""
    one, one_args, many, many_args = script.calls(2, num_experts=4, d_model=128, d_expert=256)
    size = 4 * 256 * 128
    for fn, args in ((one, one_args), (many, many_args)):
        assert whole_matrix_ops(fn.lower(*args).compile().as_text(), size) == []
