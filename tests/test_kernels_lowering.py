"""Cross-lowering of the fused step kernel to CUDA (Triton) on a machine without a GPU, and the
one-kernel-per-call count (docs/semantics.md §7).

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the Pallas Triton lowering
(the kernel jaxpr becomes a Triton MLIR module inside a ``__gpu$xla.gpu.triton`` custom call) but
compiles nothing, so a kernel that only works in interpret mode fails here. Every case is
lowered with ``interpret=False`` at the pool sizes and expert counts of real models (``S >= E``
always), plain, under ``jax.vmap`` (one program per cache: ``grid_x == batch``) and inside a
``lax.scan`` decode loop. When the JAX internals allow it, every Triton module produced is also
run through the MLIR verifier (power-of-two tensor sizes and the other Triton op invariants).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax


SIZES = [64, 2048, 16384]
EXPERTS = [16, 128, 256]
MODES = ["plain", "vmap", "scan"]
BATCH = 3
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


@pytest.fixture
def triton_modules(monkeypatch):
    """Collects the verifier result of every Triton module lowered during the test."""
    try:
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:  # pragma: no cover - see test_the_mlir_verifier_is_hooked
        return None
    original = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:  # pragma: no cover - see test_the_mlir_verifier_is_hooked
        return None
    results = []

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        results.append(result.module.operation.verify())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", capture)
    return results


def lower_cuda(fn, *args) -> str:
    # A fresh jit per call, so no lowering is served from a cache.
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def check_triton(text: str, modules, *, grid_x: int | None = None):
    assert any(t in text for t in TRITON_TARGETS), "no Triton custom call in the lowering"
    assert "mosaic" not in text.lower(), "lowered with Mosaic GPU instead of Triton"
    if modules is not None:
        assert modules, "the Triton lowering rule did not run"
        assert all(modules), "a Triton module failed MLIR verification"
    grids = re.findall(r"grid_x = (\d+) : i32", text)
    if grid_x is not None and grids:  # the jaxlib <= 0.10.2 custom-call format
        assert {int(g) for g in grids} == {grid_x}


# The counting rule (docs/semantics.md §7): every ``stablehlo.<op>`` of the lowered text but
# these, and not the attributes (``#stablehlo.output_operand_alias<...>`` names no operation).
UNCOUNTED = {"constant", "reshape", "bitcast_convert", "return", "custom_call", "tuple",
             "get_tuple_element", "optimization_barrier"}
PALLAS_CALL = "custom_call @__gpu$xla.gpu.triton"


def count_ops(text: str) -> tuple[int, int]:
    """``(Pallas custom calls, other ops)`` of a lowered module by the counting rule: a private
    function's body counts once (it is printed once), a scan's while body once plus its loop
    bookkeeping (the condition and counter ops around it)."""
    pallas = text.count(PALLAS_CALL)
    ops = [op for op in re.findall(r"(?<![#\w])stablehlo\.([a-z_0-9]+)", text)
           if op not in UNCOUNTED]
    return pallas, len(ops)


def test_count_ops_follows_the_rule():
    """FAILS if the counter counts the uncounted ops or attributes, or misses a counted op."""
    text = ("%0 = stablehlo.constant dense<1> : tensor<i32>\n"
            "%1 = stablehlo.add %0, %0 : tensor<i32>\n"
            "%2 = stablehlo.custom_call @__gpu$xla.gpu.triton(%1) "
            "{output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], "
            "operand_index = 0, operand_tuple_indices = []>]}\n"
            "%3 = stablehlo.reshape %2 : tensor<1xi32>\n"
            "%4 = stablehlo.select %1, %0, %0 : tensor<i32>\n"
            "stablehlo.return %4 : tensor<i32>\n")
    assert count_ops(text) == (1, 2)


# (L, E, S, k): the geometries the one-kernel-per-call rule is held to.
STEP_GEOMETRIES = [(8, 16, 64, 8), (32, 8, 128, 2), (48, 128, 2048, 8), (64, 320, 16384, 8)]
HYBRID_RULES = [(order, admission) for order in ("recency", "lowest_id")
                for admission in ("promote_one", "none", "reuse")]
MAX_OTHER_OPS = 16
# A lax.scan's own bookkeeping around its body: the while's condition (compare), the counter
# (add) and the per-iteration slicing and stacking of its xs/ys.
SCAN_BOOKKEEPING = 16


def _step_calls(num_layers, num_experts, size, top_k, eviction="lru"):
    import pallas_cache as pc

    state = pc.init(num_layers, num_experts, size, eviction=eviction)
    routes = jnp.arange(top_k, dtype=jnp.int32) % num_experts
    policy = pc.FetchPolicy.fraction(0.4)
    calls = {"ensure": lambda s, layer: pc.ensure(s, layer, routes, backend="pallas")}
    for order, admission in HYBRID_RULES:
        if admission == "reuse" and eviction != "lru":
            continue
        calls[f"ensure_hybrid/{order}/{admission}"] = functools.partial(
            lambda s, layer, o, a: pc.ensure_hybrid(s, layer, routes, policy, order=o,
                                                    admission=a, backend="pallas"),
            o=order, a=admission)
    return state, calls


@pytest.mark.parametrize("eviction", ["lru", "pair_lfu"])
@pytest.mark.parametrize("geometry", STEP_GEOMETRIES)
def test_one_kernel_and_at_most_16_other_ops_per_call(geometry, eviction, triton_modules):
    """FAILS if a call of ``ensure`` / ``ensure_hybrid`` (any order and admission) under
    ``backend="pallas"`` lowers to anything but exactly one Triton kernel and at most 16 other
    ops, with a traced layer: plain, under ``vmap`` over 4 states, and in a ``lax.scan`` of
    layer-calls (16 + the loop's own bookkeeping). The XLA step, or the old victims kernel
    beside an XLA step, lowers to hundreds of ops."""
    state, calls = _step_calls(*geometry, eviction=eviction)
    batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (4, *x.shape)), state)
    layers = jnp.arange(geometry[0], dtype=jnp.int32)
    for name, call in calls.items():
        plain = count_ops(lower_cuda(lambda s, layer: call(s, layer), state, jnp.int32(1)))
        assert plain[0] == 1 and plain[1] <= MAX_OTHER_OPS, (name, plain)
        vmapped = count_ops(lower_cuda(jax.vmap(lambda s: call(s, jnp.int32(1))), batched))
        assert vmapped[0] == 1 and vmapped[1] <= MAX_OTHER_OPS, (name, "vmap", vmapped)
        scanned = count_ops(lower_cuda(
            lambda s: lax.scan(lambda s, layer: (call(s, layer)[0], None), s, layers)[0], state))
        assert scanned[0] == 1 and scanned[1] <= MAX_OTHER_OPS + SCAN_BOOKKEEPING, (
            name, "scan", scanned)
    check_triton(lower_cuda(lambda s: calls["ensure"](s, jnp.int32(0)), state), triton_modules)


@pytest.mark.parametrize("eviction", ["route_knn", "route_lfu"])
def test_ring_evictions_keep_their_step_outside_the_kernel(eviction):
    """The ring policies rank in XLA (docs/semantics.md §5.16): FAILS if their ``backend="pallas"``
    step launches a Pallas kernel it was not built for, or stops lowering for CUDA."""
    state, calls = _step_calls(8, 16, 64, 8, eviction=eviction)
    pallas, others = count_ops(lower_cuda(lambda s: calls["ensure"](s, jnp.int32(1)), state))
    assert pallas == 0 and others > MAX_OTHER_OPS


ENSURE_SHAPES = [(s, e) for s in SIZES for e in EXPERTS if e <= s]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size,num_experts", ENSURE_SHAPES)
def test_ensure_hybrid_with_the_pallas_backend_lowers_to_triton(size, num_experts, mode,
                                                                triton_modules):
    """The whole cache step, not just the kernels: FAILS if any path of ``ensure_hybrid`` under
    ``backend="pallas"`` falls back to interpret mode or to Mosaic GPU."""
    import pallas_cache as pc

    num_layers, top_k = 4, 8
    state = pc.init(num_layers, num_experts, size)
    policy = pc.FetchPolicy.fraction(0.4)
    routes = jnp.arange(top_k, dtype=jnp.int32) % num_experts

    def step(state, layer, routes, policy):
        return pc.ensure_hybrid(state, layer, routes, policy, backend="pallas")

    if mode == "plain":
        text = lower_cuda(step, state, jnp.int32(1), routes, policy)
    elif mode == "vmap":
        batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH, *x.shape)), (state, policy))
        text = lower_cuda(jax.vmap(lambda s, p: step(s, jnp.int32(1), routes, p)), *batched)
    else:
        def decode(state):
            def body(state, layer):
                state, plan = step(state, layer, routes, policy)
                return state, plan.copy.count
            return lax.scan(body, state, jnp.arange(num_layers, dtype=jnp.int32))
        text = lower_cuda(decode, state)
    check_triton(text, triton_modules)


# A usable size below the capacity (docs/semantics.md §5.15): the size reaches the kernel as a
# traced scalar, so one lowering serves every size; (capacity, usable size, experts).
USABLE_SHAPES = [(2048, 64, 16), (16384, 2048, 128), (100, 8, 7)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("capacity,cache_size,num_experts", USABLE_SHAPES)
def test_the_step_lowers_with_a_usable_size_below_the_capacity(capacity, cache_size, num_experts,
                                                               mode, triton_modules):
    """FAILS if the usable-size mask (a traced scalar input of the kernel) does not lower to
    Triton, plain, under ``vmap`` (a batch of sizes) or in a decode scan, or if the
    ``ensure_hybrid`` step on such a state falls back to interpret mode or Mosaic GPU."""
    import pallas_cache as pc

    state = pc.init(4, num_experts, cache_size, capacity=capacity)
    policy = pc.FetchPolicy.fraction(0.4)
    routes = jnp.arange(8, dtype=jnp.int32) % num_experts

    def step(state, layer):
        return pc.ensure_hybrid(state, layer, routes, policy, backend="pallas")

    if mode == "plain":
        text = lower_cuda(step, state, jnp.int32(1))
    elif mode == "vmap":
        sizes = jnp.asarray([num_experts, cache_size, capacity], jnp.int32)
        states = jax.vmap(lambda c: pc.resize(state, c)[0])(sizes)
        text = lower_cuda(jax.vmap(lambda s: step(s, jnp.int32(1))), states)
        check_triton(text, triton_modules, grid_x=3)
    else:
        def decode(state):
            def body(state, layer):
                state, plan = step(state, layer)
                return state, plan.copy.count
            return lax.scan(body, state, jnp.arange(4, dtype=jnp.int32))
        text = lower_cuda(decode, state)
    check_triton(text, triton_modules)


# The two checks above that lean on JAX internals (the MLIR verifier hook, the ``grid_x`` attribute
# of the custom call) silently do nothing when the internals move; these canaries turn that into a
# visible SKIP in the test summary instead.


def _ensure_call(state):
    import pallas_cache as pc

    return pc.ensure(state, jnp.int32(1), jnp.arange(4, dtype=jnp.int32), backend="pallas")


def test_the_mlir_verifier_is_hooked(triton_modules):
    """SKIPS (visibly) when the Triton lowering internals moved and no module is verified."""
    import pallas_cache as pc

    if triton_modules is None:
        pytest.skip("jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module is gone: "
                    "Triton modules are lowered but not run through the MLIR verifier")
    lower_cuda(_ensure_call, pc.init(2, 7, 100))
    assert triton_modules and all(triton_modules)


def test_the_grid_check_is_active():
    """SKIPS (visibly) when the custom call no longer spells ``grid_x``, so the vmapped tests
    cannot check one program per cache; FAILS if it is spelled and wrong."""
    import pallas_cache as pc

    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH, *x.shape)), pc.init(2, 7, 64))
    text = lower_cuda(jax.vmap(_ensure_call), states)
    grids = re.findall(r"grid_x = (\d+) : i32", text)
    if not grids:
        pytest.skip("the lowered custom call has no grid_x attribute in this jaxlib")
    assert {int(g) for g in grids} == {BATCH}
