"""The promotion scenarios of docs/semantics.md §5.5, run by the library.

Each scenario runs as one compiled ``lax.scan`` per admission rule (``pallas-cache scenarios``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache.ops import ensure_hybrid
from pallas_cache.policy import Admission, FetchPolicy
from pallas_cache.state import init

NUM_LAYERS, NUM_EXPERTS, CACHE_SIZE, TOP_K, STEPS = 8, 16, 64, 8, 256


@dataclasses.dataclass(frozen=True)
class ScenarioCounts:
    """Counters of one scenario under one admission rule."""

    fetches: int  # copy entries over the whole run (after the warm-up call)
    cpu_routes: int  # routes assigned to the CPU
    empty_slots: int  # slots still empty at the end


@jax.jit
def _run(state, layers, admission_is_promote):
    routes = jnp.arange(TOP_K, dtype=jnp.int32)
    policy = FetchPolicy.fraction(0.4)

    def body(carry, layer):
        state, fetches, cpu = carry

        def step(admission):
            return lambda s: ensure_hybrid(s, layer, routes, policy, admission=admission)

        state, plan = lax.cond(
            admission_is_promote, step(Admission.PROMOTE_ONE), step(Admission.NONE), state)
        return (state, fetches + plan.copy.count, cpu + jnp.sum(plan.cpu, dtype=jnp.int32)), None

    (state, fetches, cpu), _ = lax.scan(body, (state, jnp.int32(0), jnp.int32(0)), layers)
    return state, fetches, cpu


def one_active_layer(admission) -> ScenarioCounts:
    """Layer 0 only, experts 0..6 pre-resident, then routes 0..7 for 256 steps."""
    admission = Admission.coerce(admission)
    state = init(NUM_LAYERS, NUM_EXPERTS, CACHE_SIZE)
    state, _ = ensure_hybrid(state, 0, jnp.arange(7), FetchPolicy.fixed_cap(7), admission=admission)
    layers = jnp.zeros(STEPS, jnp.int32)
    state, fetches, cpu = _run(state, layers, admission is Admission.PROMOTE_ONE)
    return ScenarioCounts(int(fetches), int(cpu), int(jnp.sum(state.residency.id_of_slot < 0)))


def all_layers_cold(admission) -> ScenarioCounts:
    """All 8 layers route 0..7, token by token, from a cold cache for 256 steps each."""
    admission = Admission.coerce(admission)
    state = init(NUM_LAYERS, NUM_EXPERTS, CACHE_SIZE)
    layers = jnp.tile(jnp.arange(NUM_LAYERS, dtype=jnp.int32), STEPS)
    state, fetches, cpu = _run(state, layers, admission is Admission.PROMOTE_ONE)
    return ScenarioCounts(int(fetches), int(cpu), int(jnp.sum(state.residency.id_of_slot < 0)))


def promotion_table() -> list[tuple[str, int, int]]:
    """The five rows of the promotion scenarios' table: ``(scenario, NONE value, PROMOTE_ONE value)``."""
    one = {a: one_active_layer(a) for a in (Admission.NONE, Admission.PROMOTE_ONE)}
    cold = {a: all_layers_cold(a) for a in (Admission.NONE, Admission.PROMOTE_ONE)}
    n, p = Admission.NONE, Admission.PROMOTE_ONE
    return [
        ("One active layer, 7 experts initially resident: additional fetches",
         one[n].fetches, one[p].fetches),
        ("Same scenario: CPU-assigned routes", one[n].cpu_routes, one[p].cpu_routes),
        ("All 8 layers active with fixed top-8, empty cache: total fetches",
         cold[n].fetches, cold[p].fetches),
        ("Same scenario: CPU-assigned routes", cold[n].cpu_routes, cold[p].cpu_routes),
        ("Same scenario: empty slots after 256 steps", cold[n].empty_slots, cold[p].empty_slots),
    ]
