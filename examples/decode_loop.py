"""A whole hybrid MoE decode loop compiled into one program, checked against the dense MoE.

A small random-weight MoE (4 layers, 16 experts per layer, top-2 routing, hidden size 64; each
expert a two-matrix MLP, each layer residual) decodes a stream of tokens. Everything runs inside
one ``jax.jit``: a ``lax.scan`` over tokens, and inside it a ``lax.scan`` over layers with a
*traced* layer index. Per layer and token:

1. route: router matmul, ``top_k``, softmax over the chosen logits (the gates);
2. plan: ``ensure_hybrid`` decides which experts are on the device, which are copied in (into
   which slot) and which are computed on the CPU;
3. copy: ``apply_copy_plan`` moves the fetched experts from the host bank into the pool;
4. compute: ``moe_hybrid``, gate-weighted, added to the residual stream. Its device partial runs
   the resident and fetched experts from the pool on the device; its CPU partial
   (``cpu_partial``) runs the plan's distinct CPU experts on the host CPU, reading them from
   the host bank inside a ``compute_on("device_host")`` region, one expert read per CPU expert
   (on the CPU backend the host is the device, so both partials run on the same cores).

The same scan also runs the dense MoE (every expert read straight from the host bank) on the same
token stream, so every step of the cached path can be compared with the oracle. The two agree to
float rounding whenever the plans are right: a wrong slot, a dropped copy or a CPU route that was
also given a slot makes them differ, which is what ``tests/core/test_apply.py`` checks.

The token stream is fixed in advance (random ids, a few rows padded to ``-1`` to stand for empty
batch rows), as when scoring a given sequence one token per step. A greedy model with random
weights would soon repeat one token and route to the same experts forever, which would exercise
nothing.

Run ``python examples/decode_loop.py`` for the maximum error and the cache statistics: per
policy and size, the routed experts split into hits, fetches and CPU-computed misses (distinct
experts per layer call, summed), and the CPU routes (every row's route, duplicates counted).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_cache as pc
from pallas_cache.moe import apply_copy_plan, put_host_bank
from pallas_cache.testing import moe_dense


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry of the toy model.

    Attributes:
      num_layers: MoE layers ``L``.
      num_experts: experts per layer ``E``.
      top_k: experts routed per token.
      hidden: model width ``H``.
      ffn: expert MLP width.
      batch: tokens decoded per step (rows; a row may be padding).
      vocab: embedding table size.
    """

    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 2
    hidden: int = 64
    ffn: int = 32
    batch: int = 2
    vocab: int = 256


@dataclasses.dataclass(frozen=True)
class ModelParams:
    """Random weights. ``experts`` is the host bank: leaves ``[L, E, ...]``.

    Attributes:
      embed: ``[vocab, H]``.
      router: ``[L, H, E]``.
      experts: ``{"w_in": [L, E, H, ffn], "w_out": [L, E, ffn, H]}``.
    """

    embed: jax.Array
    router: jax.Array
    experts: dict


jax.tree_util.register_dataclass(ModelParams, data_fields=["embed", "router", "experts"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """Per-step outputs of both paths and the final cache.

    Attributes:
      cached: ``[T, B, H]`` the hybrid cached path's final hidden state of every token.
      dense: ``[T, B, H]`` the same for the dense MoE.
      state: the cache after the last step.
      pool: the device pool after the last step (slot ``s`` holds the expert ``state`` says).
      fetched, cpu_routes: ``[T, L]`` experts copied in and CPU-assigned routes per layer call.
    """

    cached: jax.Array
    dense: jax.Array
    state: pc.CacheState
    pool: dict
    fetched: jax.Array
    cpu_routes: jax.Array


jax.tree_util.register_dataclass(
    DecodeResult, data_fields=["cached", "dense", "state", "pool", "fetched", "cpu_routes"], meta_fields=[])


def expert_mlp(weights, x):
    """One expert on one token: ``gelu(x @ w_in) @ w_out``. ``x`` is ``[H]``."""
    return jax.nn.gelu(x @ weights["w_in"]) @ weights["w_out"]


def init_params(seed: int = 0, config: ModelConfig = ModelConfig()) -> ModelParams:
    """Random weights (NumPy's generator: instant, no compile), scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    L, E, H, F = config.num_layers, config.num_experts, config.hidden, config.ffn

    def normal(shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(fan_in))

    return ModelParams(
        embed=normal((config.vocab, H), 1),
        router=normal((L, H, E), H),
        experts={"w_in": normal((L, E, H, F), H), "w_out": normal((L, E, F, H), F)},
    )


def make_tokens(seed: int, num_steps: int, config: ModelConfig = ModelConfig(),
                padding_rate: float = 0.1) -> jax.Array:
    """A ``[num_steps, batch]`` int32 token stream; about ``padding_rate`` of the rows are -1."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab, (num_steps, config.batch), dtype=np.int32)
    padded = rng.random(ids.shape) < padding_rate
    return jnp.asarray(np.where(padded, -1, ids).astype(np.int32))


def new_pool(config: ModelConfig, cache_size: int):
    """An all-zero device pool of ``cache_size`` slots, leaves ``[S, ...]``."""
    return {
        "w_in": jnp.zeros((cache_size, config.hidden, config.ffn), jnp.float32),
        "w_out": jnp.zeros((cache_size, config.ffn, config.hidden), jnp.float32),
    }


def route(h, router_weights, active_rows, top_k: int):
    """Router: ``top_k`` experts per token and their softmax gates; padding rows route to -1."""
    logits = h @ router_weights
    top_logits, expert_ids = lax.top_k(logits, top_k)
    gates = jax.nn.softmax(top_logits, axis=-1)
    return jnp.where(active_rows[:, None], expert_ids, -1).astype(jnp.int32), gates


@functools.partial(jax.jit, static_argnames=("config", "order", "admission", "tamper"),
                   donate_argnames=("cache", "pool"))  # updated in place where supported
def _decode(params, tokens, cache, pool, policy, *, config, order, admission, tamper):
    host_bank = params.experts
    layers = jnp.arange(config.num_layers, dtype=jnp.int32)

    def token_step(carry, token_row):
        cache, pool = carry
        active_rows = token_row >= 0
        h0 = jnp.where(active_rows[:, None], params.embed[jnp.maximum(token_row, 0)], 0.0)

        def layer_step(carry, layer):
            cache, pool, h_cached, h_dense = carry
            router_weights = params.router[layer]

            expert_ids, gates = route(h_cached, router_weights, active_rows, config.top_k)
            cache, plan = pc.ensure_hybrid(cache, layer, expert_ids, policy,
                                           order=order, admission=admission)
            if tamper is not None:
                plan = tamper(plan)
            pool = apply_copy_plan(pool, host_bank, plan, layer=layer)
            h_cached = h_cached + pc.moe_hybrid(h_cached, expert_ids, gates, plan, pool,
                                                host_bank, expert_mlp, layer=layer)

            dense_ids, dense_gates = route(h_dense, router_weights, active_rows, config.top_k)
            h_dense = h_dense + moe_dense(h_dense, dense_ids, dense_gates, host_bank, expert_mlp,
                                          layer=layer)
            counts = (plan.copy.count, jnp.sum(plan.cpu, dtype=jnp.int32))
            return (cache, pool, h_cached, h_dense), counts

        (cache, pool, h_cached, h_dense), (fetched, cpu_routes) = lax.scan(
            layer_step, (cache, pool, h0, h0), layers)
        return (cache, pool), (h_cached, h_dense, fetched, cpu_routes)

    (cache, pool), (cached, dense, fetched, cpu_routes) = lax.scan(
        token_step, (cache, pool), tokens)
    return DecodeResult(cached=cached, dense=dense, state=cache, pool=pool, fetched=fetched,
                        cpu_routes=cpu_routes)


def decode(params: ModelParams, tokens, cache_size: int, policy: pc.FetchPolicy, *,
           config: ModelConfig = ModelConfig(), order=pc.FetchOrder.RECENCY,
           admission=pc.Admission.PROMOTE_ONE,
           tamper: Callable[[pc.EnsurePlan], pc.EnsurePlan] | None = None) -> DecodeResult:
    """Decode ``tokens`` through the cached hybrid path and the dense MoE, in one compiled scan.

    Args:
      params: the model; ``params.experts`` is the host bank (put it in host memory with
        ``put_host_bank`` first, or leave it in device memory; results are the same).
      tokens: ``[T, B]`` int32 token ids, -1 = padding row.
      cache_size: ``S``, device slots (``>= E``).
      policy: the fetch policy; traced, so changing it does not recompile.
      config: the model geometry.
      order, admission: passed to ``ensure_hybrid``.
      tamper: optional ``plan -> plan`` applied to every plan before it is used (static). For
        tests: a corrupted plan must make the cached path disagree with the dense one.

    Returns:
      A :class:`DecodeResult` with per-step outputs of both paths and the final cache.
    """
    cache = pc.init(config.num_layers, config.num_experts, cache_size)
    pool = new_pool(config, cache_size)
    # Full f32 matmuls: a GPU's default rounds f32 matmul inputs to TF32, and the cached and
    # dense paths, which sum the same experts in different groupings, then differ by ~2e-4
    # (measured on an H200) instead of f32 rounding.
    with jax.default_matmul_precision("highest"):
        return _decode(params, tokens, cache, pool, policy, config=config,
                       order=pc.FetchOrder.coerce(order),
                       admission=pc.Admission.coerce(admission), tamper=tamper)


def max_error(result: DecodeResult) -> float:
    """Largest absolute difference between the cached and the dense outputs, over all steps."""
    return float(jnp.max(jnp.abs(result.cached - result.dense)))


def main(num_steps: int = 300, seed: int = 0) -> None:
    config = ModelConfig()
    params = init_params(seed, config)
    params = dataclasses.replace(params, experts=put_host_bank(params.experts))
    placement = jax.tree.leaves(params.experts)[0].sharding.memory_kind
    tokens = make_tokens(seed + 1, num_steps, config)
    E = config.num_experts
    print(f"model: L={config.num_layers} E={E} top-{config.top_k} H={config.hidden}, "
          f"{num_steps} steps x {config.batch} rows; host bank in {placement!r} memory")
    print("counts: summed over layer calls, a call counting each distinct expert once: routed = "
          "hits + fetched + cpu (misses computed on the CPU), missing = fetched + cpu;\n"
          "cpu routes: every (row, route) the CPU computed (an expert two rows route to counts "
          "twice)")
    for name, policy in [("full", pc.FetchPolicy.full()),
                         ("fraction 0.4", pc.FetchPolicy.fraction(0.4)),
                         ("cap 1", pc.FetchPolicy.fixed_cap(1))]:
        for cache_size in (E, 3 * E):
            result = decode(params, tokens, cache_size, policy, config=config)
            totals = pc.stats(result.state)
            print(f"{name:>12}  S={cache_size:3d}  max|cached - dense| = {max_error(result):.2e}  "
                  f"routed={totals.active} = hits {totals.hits} + fetched {totals.fetched} "
                  f"+ cpu {totals.cpu_experts} (missing={totals.missing})  "
                  f"cpu routes={int(result.cpu_routes.sum())}  "
                  f"miss rate={totals.miss_rate:.3f} fetch rate={totals.fetch_rate:.3f}")


if __name__ == "__main__":
    main()
