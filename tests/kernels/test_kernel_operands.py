"""The fused kernel takes every state leaf it rewrites in the leaf's own shape (docs/design.md,
"The kernel's operands"): lowered for CUDA, a ``lax.scan`` of the step compiled by XLA with a
CPU stand-in for the Triton call (same operands and aliases) has no copy of a state leaf in its
loop body, only the scan's own counter copy. A reshaped aliased operand costs a copy in and a
copy out per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallas_cache as pc
from benchmarks.lowering import loop_body_census, scan_census

EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
GEOMETRIES = ((8, 16, 64, 8), (48, 128, 4096, 8))


def _call(hybrid: bool, k: int, num_experts: int):
    routes = jnp.arange(k, dtype=jnp.int32) % num_experts
    if hybrid:
        policy = pc.FetchPolicy.fraction(0.4)
        return lambda s, layer: pc.ensure_hybrid(s, layer, routes, policy, backend="pallas")
    return lambda s, layer: pc.ensure(s, layer, routes, backend="pallas")


def _scans(call, num_layers: int):
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    state_only = lambda s: lax.scan(lambda s, l: (call(s, l)[0], None), s, layers)[0]  # noqa: E731
    stacked = lambda s: lax.scan(call, s, layers)  # noqa: E731
    return {"state": state_only, "plans": stacked}


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: ",".join(map(str, g)))
@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("hybrid", (False, True), ids=("ensure", "ensure_hybrid"))
def test_no_copy_of_a_state_leaf_around_the_call(geometry, eviction, hybrid):
    L, E, S, k = geometry
    if hybrid and geometry != GEOMETRIES[0]:
        pytest.skip("one hybrid variant per eviction")
    state = pc.init(L, E, S, eviction=eviction, history=128)
    for kind, scan in _scans(_call(hybrid, k, E), L).items():
        census = scan_census(scan, state)
        assert census["calls"] == 1, (kind, census)
        assert census["counter_copies"] == 1, (kind, census)
        assert census["copies"] == 0, (kind, census["copy_shapes"])


def test_no_copy_under_vmap():
    """A scan over a batch of states (``vmap`` adds the kernel's batch axis): no copy either."""
    L, E, S, k = 8, 16, 64, 8
    state = pc.init(L, E, S, eviction="route_lfu", history=128)
    batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (3, *x.shape)), state)
    call = jax.vmap(_call(False, k, E), in_axes=(0, None))
    census = scan_census(_scans(call, L)["state"], batched)
    assert census["calls"] == 1 and census["copies"] == 0, census["copy_shapes"]


def test_the_census_counts_a_reshaped_aliased_operand():
    """The census itself: a stand-in call whose aliased operand is a reshaped loop-carried
    buffer (what the kernel did) shows its copy in and out; the scan's counter copy is apart."""
    text = """
HloModule m, entry_computation_layout={(s32[4,2]{1,0})->s32[4,2]{1,0}}

%fused (p: s32[4,2]) -> s32[8] {
  %p = s32[4,2]{1,0} parameter(0)
  %b = s32[8]{0} bitcast(%p)
  ROOT %c = s32[8]{0} copy(%b)
}

%body (arg_tuple.1: (s32[], s32[4,2])) -> (s32[], s32[4,2]) {
  %arg_tuple.1 = (s32[], s32[4,2]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg_tuple.1), index=0
  %x = s32[4,2]{1,0} get-tuple-element(%arg_tuple.1), index=1
  %ci = s32[] copy(%i)
  %in = s32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %cc = s32[8]{0} custom-call(%in), custom_call_target="dce_sink", output_to_operand_aliasing={{}: (0, {})}
  %back = s32[4,2]{1,0} bitcast(%cc)
  %out = s32[4,2]{1,0} copy(%back)
  ROOT %t = (s32[], s32[4,2]{1,0}) tuple(%ci, %out)
}

ENTRY %main (a: s32[4,2]) -> s32[4,2] {
  %a = s32[4,2]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], s32[4,2]{1,0}) tuple(%z, %a)
  %w = (s32[], s32[4,2]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"},"known_induction_variable":{"tuple_index":"0"}}
  ROOT %r = s32[4,2]{1,0} get-tuple-element(%w), index=1
}
"""
    census = loop_body_census(text)
    assert census == {"copies": 2, "counter_copies": 1, "fusions": 0, "calls": 1, "others": 0,
                      "copy_shapes": ["s32[8]{0}", "s32[4,2]{1,0}"]}
