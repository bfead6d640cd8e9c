"""What must hold on every JAX the pin admits (jax 0.10.2 on Python 3.11 to 0.12 on 3.13): the
fused kernel at sizes that are not powers of two, lowered for CUDA without a GPU, the Pallas
Triton deprecation handled by the backend switch, and one compile per jitted step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from benchmarks.lowering import PALLAS_CALL, lower_cuda
from pallas_cache.kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")


def _run(backend, L, E, S, eviction, routes):
    state, plans = pc.init(L, E, S, eviction=eviction), []
    policy = pc.FetchPolicy.fraction(0.5)
    for token in range(3):
        for layer in range(L):
            state, plan = pc.ensure_hybrid(state, jnp.int32(layer), routes[token, layer], policy,
                                           backend=backend)
            plans.append(plan)
    return state, plans


@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("L,E,S,K", [(4, 16, 24, 3), (3, 10, 20, 5)])
def test_the_kernel_at_sizes_that_are_not_powers_of_two_equals_the_xla_step(L, E, S, K, eviction):
    """FAILS on jax 0.12 with a slice wider than its ref (``pl.ds(0, next_pow2(n))``): "Out of
    bound slice" at trace time for every capacity, route count or history width that is not a
    power of two. Whole states and plans equal the XLA step's after every call."""
    routes = jnp.asarray(np.random.default_rng(L * E + S).integers(-1, E, (3, L, K)), jnp.int32)
    want_state, want = _run("xla", L, E, S, eviction, routes)
    got_state, got = _run("interpret", L, E, S, eviction, routes)
    for a, b in zip(want, got):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    jax.tree.map(np.testing.assert_array_equal, want_state, got_state)


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_the_kernel_lowers_for_cuda_without_a_gpu_at_sizes_that_are_not_powers_of_two(eviction):
    """FAILS on jax >= 0.11 without :func:`benchmarks.lowering.abstract_gpu` ("No supported GPU
    devices found"), and on 0.12 with an over-wide slice: one Triton call per step."""
    state = pc.init(3, 10, 20, eviction=eviction)
    routes = jnp.array([1, 4, 7], jnp.int32)
    text = lower_cuda(lambda s: pc.ensure_hybrid(s, jnp.int32(1), routes,
                                                 pc.FetchPolicy.full(), backend="pallas"),
                      state).as_text()
    assert text.count(PALLAS_CALL) == 1


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def test_a_missing_triton_module_falls_back_to_xla_and_refuses_pallas(on_a_gpu, monkeypatch):
    """FAILS if the default path picks ``"pallas"`` on a JAX whose Triton module is gone."""
    assert dispatch.resolve_backend(None) == "pallas"
    import jax.experimental.pallas as pallas

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    monkeypatch.delattr(pallas, "triton", raising=False)
    assert dispatch.resolve_backend(None) == "xla"
    with pytest.raises(ValueError, match=f"backend 'pallas'.*JAX {jax.__version__}.*'xla'"):
        dispatch.resolve_backend("pallas")


def test_an_accelerated_triton_deprecation_falls_back_to_xla_and_refuses_pallas(on_a_gpu):
    """FAILS if the default path keeps ``"pallas"`` when JAX makes the deprecation an error
    (every call would then raise at lowering); an explicit ``"pallas"`` raises one ValueError
    naming the JAX version and the way out."""
    deprecations = pytest.importorskip("jax._src.deprecations")
    if dispatch.TRITON_DEPRECATION not in getattr(deprecations, "_registered_deprecations", {}):
        pytest.skip(f"jax {jax.__version__} has no {dispatch.TRITON_DEPRECATION!r} deprecation")
    assert dispatch.resolve_backend(None) == "pallas"
    deprecations.accelerate(dispatch.TRITON_DEPRECATION)
    try:
        assert dispatch.resolve_backend(None) == "xla"
        with pytest.raises(ValueError, match=f"JAX {jax.__version__}.*deprecation.*'xla'"):
            dispatch.resolve_backend("pallas")
    finally:
        deprecations._registered_deprecations[dispatch.TRITON_DEPRECATION].accelerated = False
    assert dispatch.resolve_backend(None) == "pallas"


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                          textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_lowering_the_kernel_does_not_warn_of_the_triton_deprecation():
    """FAILS on jax >= 0.11 without the filter ``pallas_cache.kernels`` installs: the lowering
    warns (here, with DeprecationWarning made an error, raises) on every compile."""
    _python("""
        import jax.numpy as jnp
        import pallas_cache as pc
        from benchmarks.lowering import lower_cuda
        lower_cuda(lambda s: pc.ensure(s, 1, jnp.array([1, 2], jnp.int32), backend="pallas"),
                   pc.init(2, 4, 6))
    """)


def test_the_first_jitted_step_compiles_once():
    """FAILS on jax 0.12 when Pallas' modules are first imported inside the trace: the second
    call of the same jitted step compiles it again (a fresh process, as a user's first step)."""
    out = _python("""
        import jax, jax.numpy as jnp
        import pallas_cache as pc
        compiles = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, _, **kw: compiles.append(event)
            if event.endswith("backend_compile_duration") else None)
        state, routes = pc.init(4, 16, 24), jnp.array([1, 2, 3], jnp.int32)
        step = jax.jit(lambda s, l, r: pc.ensure(s, l, r, backend="interpret"))
        jax.block_until_ready(step(state, jnp.int32(1), routes))
        first = len(compiles)
        jax.block_until_ready(step(state, jnp.int32(2), routes))
        print(len(compiles) - first)
    """)
    assert out.split()[-1] == "0"
