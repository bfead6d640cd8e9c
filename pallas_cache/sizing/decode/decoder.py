"""One row's compiled decode: :class:`RowSpec` (what a row is), the jitted decode of a routing
trace one token at a time (``ensure_hybrid``, ``apply_copy_plan``, ``moe_hybrid`` in a
``lax.scan`` over layers inside one over tokens), and :class:`Decoder`, which holds the bank, the
routes and the compiled programs of one run and times a row."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_cache as pc
from pallas_cache import experts
from pallas_cache.moe import apply_copy_plan
from pallas_cache.sizing.decode.bank import Geometry, expert_fn_and_bank
from pallas_cache.sizing.sweep import parse_policy

__all__ = ["Decoder", "RowSpec", "median_seconds"]


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One row to decode.

    Attributes:
      kind: ``"resident"`` (every expert resident: a primed pool of ``L * E`` slots),
        ``"no-cache"`` (each call plans from a cold cache of ``E`` slots: its routed experts are
        copied every time) or ``"cache"``.
      cache_size: the pool's slots.
      policy / eviction: the cache's fetch policy and eviction (``"full"``/``"lru"`` for the
        other kinds); ``fraction:auto`` resolves with the measured bandwidths.
    """

    kind: str
    cache_size: int
    policy: str = "full"
    eviction: str = "lru"

    @property
    def label(self) -> str:
        if self.kind == "cache":
            return f"S={self.cache_size} {self.policy} {self.eviction}"
        return f"{self.kind} (S={self.cache_size})"


def median_seconds(run, rounds, setup=None, warmup=1):
    """The median seconds of ``rounds`` calls of ``run(setup())`` after ``warmup`` untimed ones
    (``setup`` untimed)."""
    times = []
    for i in range(warmup + rounds):
        start = setup() if setup is not None else None
        began = time.perf_counter()
        run(start) if setup is not None else run()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _decode_program(expert_fn):
    """The jitted decode of ``routes [T, L, k]``, one token at a time; returns per-call int32
    ``[T, L]`` hits, fetched and CPU-expert counts, the last hidden state, and the donated pool.
    ``cold`` (bool ``[]``, traced: the no-cache row shares its cache's program): each call plans
    from the state passed in, unchanged, so it copies every expert it routes to."""

    def decode(state, pool, bank, routes, gates, x0, policy, cold):
        num_layers = routes.shape[1]
        cold_state = state

        def pick(when_cold, otherwise):
            return jax.tree.map(lambda a, b: jnp.where(cold, a, b), when_cold, otherwise)

        def token(carry, inputs):
            def layer_step(carry, inputs):
                state, pool, h = carry
                layer, ids, g = inputs
                ids, g = ids[None], g[None]
                new_state, plan = pc.ensure_hybrid(pick(cold_state, state), layer, ids, policy)
                state = pick(state, new_state)
                pool = apply_copy_plan(pool, bank, plan, layer=layer)
                h = h + pc.moe_hybrid(h, ids, g, plan, pool, bank, expert_fn, layer=layer)
                h = h / jnp.sqrt(jnp.mean(h * h) + 1e-6)  # keep the residual stream O(1)
                counts = (plan.active - plan.missing, plan.copy.count, plan.missing - plan.fetched)
                return (state, pool, h), counts

            state, pool, h = carry
            token_routes, token_gates = inputs
            (state, pool, h), counts = lax.scan(
                layer_step, (state, pool, h),
                (jnp.arange(num_layers, dtype=jnp.int32), token_routes, token_gates))
            return (state, pool, h), counts

        (state, pool, h), counts = lax.scan(token, (state, pool, x0), (routes, gates))
        return counts, h, pool

    return jax.jit(decode, donate_argnums=(1,))


class Decoder:
    """The bank, the routes and the compiled decodes of one run (one program per eviction and
    pool size; the policy and the no-cache flag are traced)."""

    def __init__(self, geometry: Geometry, routes: np.ndarray, seed: int, progress):
        g = geometry
        self.geometry, self.progress = g, progress
        self.device = jax.devices()[0]
        self.expert_fn, self.bank = expert_fn_and_bank(g, seed=seed, device=self.device,
                                                        progress=progress)
        rng = np.random.default_rng(seed + 1)
        tokens = routes.shape[0]
        self.routes = jnp.asarray(routes, jnp.int32)
        self.gates = jnp.asarray(rng.dirichlet(np.ones(g.top_k), size=(tokens, g.num_layers))
                                 .astype(np.float32))
        self.x0 = jnp.asarray(rng.standard_normal((1, g.d_model)).astype(np.float32))
        self.programs = {}
        every = jnp.arange(g.num_experts, dtype=jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def prime_layer(state, pool, bank, layer):
            state, plan = pc.ensure(state, layer, every)
            return state, apply_copy_plan(pool, bank, plan, layer=layer)

        self._prime_layer = prime_layer

    def pool(self, slots):
        return experts.pool_like(self.bank, slots, layer_axis=True)

    def start(self, spec: RowSpec):
        """The cold (or, for the floor, primed) state and pool of a row."""
        g = self.geometry
        state = pc.init(g.num_layers, g.num_experts, spec.cache_size, eviction=spec.eviction)
        pool = self.pool(spec.cache_size)
        if spec.kind == "resident":
            state, pool = self._prime(state, pool)
        return state, pool

    def _prime(self, state, pool):
        """Every expert of every layer made resident and copied in (one call of one compiled
        program per layer, the pool donated)."""
        for layer in range(self.geometry.num_layers):
            state, pool = self._prime_layer(state, pool, self.bank, jnp.int32(layer))
        return state, pool

    def compiled(self, spec: RowSpec, policy, routes=None):
        """``(executable, compile seconds)`` of the row's decode (compiled once per program)."""
        key = (spec.eviction, spec.cache_size)
        if key not in self.programs:
            state, pool = jax.eval_shape(lambda: self.start(dataclasses.replace(spec,
                                                                                kind="cache")))
            began = time.perf_counter()
            executable = _decode_program(self.expert_fn).lower(
                state, pool, self.bank, self.routes if routes is None else routes, self.gates,
                self.x0, policy, jnp.bool_(False)).compile()
            self.programs[key] = (executable, time.perf_counter() - began)
        return self.programs[key]

    def run(self, spec: RowSpec, policy: str, repeats: int, routes=None):
        """``(median seconds, compile seconds, per-call counts)`` of the row's decode: a warm-up,
        then ``repeats`` decodes, each from a cold (or primed) cache built untimed."""
        policy = parse_policy(policy)
        routes = self.routes if routes is None else routes
        executable, compile_seconds = self.compiled(spec, policy, routes)
        cold = jnp.bool_(spec.kind == "no-cache")
        out = []

        def run(start):
            counts, h, pool = executable(*start, self.bank, routes, self.gates, self.x0, policy,
                                         cold)
            jax.block_until_ready((counts, h, pool))
            out[:] = [counts]  # not the pool: the next start makes its own (the floor's is L*E)

        seconds = median_seconds(run, repeats, setup=lambda: jax.block_until_ready(
            self.start(spec)))
        counts = tuple(np.asarray(c) for c in out[0])
        out.clear()
        return seconds, compile_seconds, counts
