"""The library's expert functions and banks (pallas_cache.experts, docs/semantics.md §5.13):
every format against a NumPy dequantize-then-multiply oracle, on the CPU path (``cpu_partial``,
which reads each expert in place) and the device path (rows copied into the pool by
``apply_copy_plan``), under jit / vmap / scan, with the interpreted kernel and the XLA step;
sizes equal to what the sizing model counts; bad banks refused naming the leaf."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache import experts, formats, hybrid
from pallas_cache.moe import apply_copy_plan, put_host_bank
from tests.core.bank_reads import whole_matrix_ops

L, E, S = 2, 4, 5
H, F = 256, 160  # F: with 64-row blocks, two of them and a tail of 32
T, K = 3, 2
FORMATS = experts.FORMATS
KINDS = {"swiglu": experts.swiglu, "mlp": experts.mlp}


# ---- the NumPy oracle ---------------------------------------------------------------------------

def np_matrix(bank: dict, name: str, fmt: str, last: bool) -> np.ndarray:
    """One stored matrix ``[..., F, H]`` as float64, dequantized by hand from the bank's bytes."""
    q = np.asarray(bank[name])
    if fmt == "fp32":
        return q.astype(np.float64)
    if fmt == "bf16":
        return (q.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    scale = np.asarray(bank[f"{name}_scale"], np.float64)
    if fmt == "int8":
        return q.astype(np.float64) * (scale[..., None, :] if last else scale[..., None])
    low = (q & 0xF).astype(np.int64)
    high = (q >> 4).astype(np.int64)
    low, high = low - 16 * (low >= 8), high - 16 * (high >= 8)  # signed nibbles
    weights = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float64)
    weights[..., 0::2], weights[..., 1::2] = low, high
    group = weights.shape[-1] // scale.shape[-1]
    return weights * np.repeat(scale, group, axis=-1)


def np_expert(bank: dict, fmt: str, kind: str, index: tuple, x: np.ndarray) -> np.ndarray:
    """The expert at ``bank[index]`` on tokens ``x [T, H]``, float64."""
    names = ("w1", "w3", "w2") if kind == "swiglu" else ("w1", "w2")
    w = {n: np_matrix(bank, n, fmt, n == names[-1])[index] for n in names}
    g = x @ w["w1"].T
    if kind == "swiglu":
        h = g / (1 + np.exp(-g)) * (x @ w["w3"].T)
    else:
        h = np.asarray(jax.nn.gelu(jnp.asarray(g, jnp.float32)), np.float64)
    return h @ w["w2"]


def _tokens(seed: int, shape=(T, H)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _tolerance(y: np.ndarray) -> float:
    return 1e-4 * (1 + np.max(np.abs(y)))


# ---- formats and the oracle ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_matches_the_numpy_oracle(fmt, kind):
    """FAILS if an expert function misreads a format (a swapped nibble, an unsigned nibble, a
    scale on the wrong axis, bf16 bits shifted wrong), whether called on one expert's weights as
    any ``expert_fn`` is, or reading the expert in place (``on_tokens``: in one block, and in a
    loop of row blocks with a tail block, F = 160 as 2 blocks of 64 and one of 32)."""
    bank = experts.random_bank(3, E, H, F, fmt, kind=kind)
    fn = KINDS[kind]
    x = _tokens(1)
    for e in (0, E - 1):
        want = np_expert(bank, fmt, kind, (e,), x.astype(np.float64))
        row = {name: leaf[e] for name, leaf in bank.items()}
        got_call = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(row, x)
        np.testing.assert_allclose(got_call, want, atol=_tolerance(want), rtol=0)
        for blocks in (fn, dataclasses.replace(fn, chunk=64)):  # one block; 64 + 64 + 32 rows
            got = jax.jit(lambda b, i, t: blocks.on_tokens(b, (i,), t))(bank, jnp.int32(e), x)
            np.testing.assert_allclose(got, want, atol=_tolerance(want), rtol=0)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_make_bank_quantizes_to_the_nearest_level(fmt):
    """FAILS if make_bank's stored weights stray from the float weights by more than half a
    level (int8: a per-output-channel scale over 127; int4: a group scale over 7; bf16: its
    rounding), or store them in another layout than ``[E, F, H]`` rows."""
    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((E, H, F)).astype(np.float32),
         "w3": rng.standard_normal((E, H, F)).astype(np.float32),
         "w2": rng.standard_normal((E, F, H)).astype(np.float32)}
    bank = experts.make_bank(w, fmt)
    for name in ("w1", "w3", "w2"):
        rows = w[name] if name == "w2" else np.swapaxes(w[name], -1, -2)
        got = np_matrix(bank, name, fmt, name == "w2")
        if fmt == "bf16":
            bound = np.abs(rows) * 2.0 ** -8
        elif fmt == "int8":
            scale = np.asarray(bank[f"{name}_scale"])
            bound = 0.5 * (scale[..., None, :] if name == "w2" else scale[..., None])
        else:
            bound = 0.5 * np.repeat(np.asarray(bank[f"{name}_scale"]), experts.INT4_GROUP, -1)
        assert np.all(np.abs(got - rows) <= bound * (1 + 1e-6) + 1e-7), name


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_per_expert_is_what_the_bank_stores_and_what_the_sizing_model_counts(fmt, kind):
    """FAILS if a format's bytes per expert (formats.bytes_per_expert, the one definition) differ
    from one expert row of the bank make_bank builds, scales included, or if the sizing model's
    ``NAME:int8`` / ``NAME:int4`` expert sizes are not that definition."""
    from pallas_cache.sizing.models import MODELS

    bank = experts.random_bank(0, 2, H, F, fmt, kind=kind)
    stored = sum(leaf[0].nbytes for leaf in bank.values())
    assert formats.bytes_per_expert(H, F, fmt, kind=kind) == stored
    model = MODELS["mixtral-8x7b"]
    assert model.expert_bytes(fmt) == formats.bytes_per_expert(model.d_model, model.d_expert, fmt)


# ---- both paths, under jit / scan / vmap, both step backends -----------------------------------

def _layer_bank(fmt: str) -> dict:
    return experts.random_bank(7, E, H, F, fmt, layers=L)


def _oracle_split(bank, fmt, x, ids, gates, plan, layer):
    """``(cpu, device)`` float64: the gate-weighted sums over the plan's CPU routes and its device
    routes, every expert evaluated by the NumPy oracle."""
    cpu = np.zeros((x.shape[0], H))
    device = np.zeros((x.shape[0], H))
    on_cpu, slots = np.asarray(plan.cpu), np.asarray(plan.slots)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] < 0:
                continue
            y = gates[t, k] * np_expert(bank, fmt, "swiglu", (layer, ids[t, k]),
                                        x[t:t + 1].astype(np.float64))[0]
            if on_cpu[t, k]:
                cpu[t] += y
            elif slots[t, k] >= 0:
                device[t] += y
    return cpu, device


def _calls(seed: int, calls: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, E, (calls, T, K)).astype(np.int32)
    gates = rng.uniform(0.1, 1, (calls, T, K)).astype(np.float32)
    x = rng.standard_normal((calls, T, H)).astype(np.float32)
    layers = rng.integers(0, L, (calls,)).astype(np.int32)
    return layers, ids, gates, x


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_and_device_partials_match_the_oracle_in_a_scan(fmt, backend):
    """FAILS if either path gives another sum than the oracle for a format: the CPU partial
    reading the host bank in place, or the device partial reading the rows (and their scale
    leaves) apply_copy_plan copied into the pool, in a jitted scan of decode calls with a traced
    layer, the plan made by the interpreted kernel or the XLA step."""
    bank = put_host_bank(_layer_bank(fmt))
    host = {name: np.asarray(leaf) for name, leaf in bank.items()}
    pool = experts.pool_like(host, S, layer_axis=True)
    layers, ids, gates, x = _calls(11, 4)
    policy = pc.FetchPolicy.fraction(0.5)

    @jax.jit
    def run(state, pool):
        def call(carry, inputs):
            state, pool = carry
            layer, i, g, v = inputs
            state, plan = pc.ensure_hybrid(state, layer, i, policy, backend=backend)
            pool = apply_copy_plan(pool, bank, plan, layer=layer)
            cpu = pc.cpu_partial(v, i, g, plan, bank, experts.swiglu, layer=layer)
            device = hybrid.device_partial(v, i, g, plan, pool, experts.swiglu)
            both = pc.moe_hybrid(v, i, g, plan, pool, bank, experts.swiglu, layer=layer)
            return (state, pool), (plan, cpu, device, both)
        return jax.lax.scan(call, (state, pool), (layers, ids, gates, x))[1]

    plans, cpu, device, both = run(pc.init(L, E, S), pool)
    used = {"cpu": 0, "device": 0}
    for c in range(len(layers)):
        plan = jax.tree.map(lambda leaf: leaf[c], plans)
        want_cpu, want_device = _oracle_split(host, fmt, x[c], ids[c], gates[c], plan, layers[c])
        used["cpu"] += int(np.any(want_cpu)); used["device"] += int(np.any(want_device))
        tol = _tolerance(want_cpu + want_device)
        np.testing.assert_allclose(cpu[c], want_cpu, atol=tol, rtol=0)
        np.testing.assert_allclose(device[c], want_device, atol=tol, rtol=0)
        np.testing.assert_allclose(both[c], want_cpu + want_device, atol=tol, rtol=0)
    assert used["cpu"] and used["device"]  # both paths did work


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_vmap_over_caches_gives_each_cache_its_own_partials(fmt):
    """FAILS if ``jit(vmap(...))`` over a batch of caches (states, routes, tokens; one shared
    bank) gives an element another result than the same call alone, on either path."""
    bank = _layer_bank(fmt)
    pool0 = experts.pool_like(bank, S, layer_axis=True)
    layers, ids, gates, x = _calls(5, 3)
    policy = pc.FetchPolicy.fraction(0.5)

    def call(state, pool, layer, i, g, v):
        state, plan = pc.ensure_hybrid(state, layer, i, policy)
        pool = apply_copy_plan(pool, bank, plan, layer=layer)
        return (pc.cpu_partial(v, i, g, plan, bank, experts.swiglu, layer=layer),
                hybrid.device_partial(v, i, g, plan, pool, experts.swiglu))

    states = pc.stack_states([pc.init(L, E, S)] * 3)
    pools = jax.tree.map(lambda leaf: jnp.stack([leaf] * 3), pool0)
    batched = jax.jit(jax.vmap(call))(states, pools, layers, ids, gates, x)
    for c in range(3):
        alone = jax.jit(call)(pc.init(L, E, S), pool0, layers[c], ids[c], gates[c], x[c])
        for got, want in zip(batched, alone):
            np.testing.assert_allclose(got[c], want, atol=_tolerance(np.asarray(want)), rtol=0)


def test_under_vmap_each_element_evaluates_only_its_own_experts():
    """FAILS if vmapping cpu_partial turns its switch on the CPU-expert count into a select that
    runs every branch: one cache with 1 CPU expert and one with none would then evaluate the
    experts of every count (1 + 2 of them), not the 1 the batch needs."""
    calls = []

    def counted(weights, x):
        jax.debug.callback(lambda: calls.append(1))
        return x * weights

    bank = jnp.ones((E, H), jnp.float32)
    ids = jnp.asarray([[[0, -1]], [[-1, -1]]], jnp.int32)  # cache 0: expert 0; cache 1: none
    gates = jnp.ones((2, 1, K), jnp.float32)
    x = jnp.ones((2, 1, H), jnp.float32)

    def one(i, g, v):
        _, plan = pc.ensure_hybrid(pc.init(1, E, E), 0, i, pc.FetchPolicy.fraction(0.0))
        return pc.cpu_partial(v, i, g, plan, bank, counted)

    jax.block_until_ready(jax.jit(jax.vmap(one))(ids, gates, x))
    jax.effects_barrier()
    assert len(calls) == 1


# ---- reading in place ---------------------------------------------------------------------------



@pytest.mark.usefixtures("optimized_xla")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_partial_reads_the_library_experts_in_place(fmt):
    """FAILS if the compiled cpu_partial computes any array as large as one expert matrix: a
    copy of an expert out of the bank (what slicing it for a plain expert_fn compiles to, checked
    below), or a whole-matrix convert (what XLA:CPU makes of a bfloat16 operand)."""
    rows, width = 1024, 512
    bank = experts.random_bank(0, 3, width, rows, fmt)
    ids = jnp.asarray([[0, 2]], jnp.int32)
    gates = jnp.full((1, 2), 0.5, jnp.float32)
    _, plan = pc.ensure_hybrid(pc.init(1, 3, 3), 0, ids, pc.FetchPolicy.fraction(0.0))
    x = jnp.ones((1, width), jnp.float32)

    def compiled(fn):
        return jax.jit(lambda b: pc.cpu_partial(x, ids, gates, plan, b, fn)).lower(
            bank).compile().as_text()

    size = bank["w1"][0].size
    assert whole_matrix_ops(compiled(experts.swiglu), size) == []
    # The same experts as a plain function are given each expert sliced out of the bank.
    assert whole_matrix_ops(compiled(lambda w, t: experts.swiglu(w, t)), size)


@pytest.mark.usefixtures("optimized_xla")
def test_under_vmap_a_batch_of_banks_or_pools_is_read_in_place_too():
    """FAILS if vmapping the partials over a batch of banks (cpu_partial) or of pools
    (device_partial) slices each element's bank or pool out of the batch (a copy of all its
    experts per element), or turns the switch into a select whose branches gather expert rows:
    the compiled program then computes arrays the size of an expert matrix."""
    rows, width = 1024, 512
    bank = experts.random_bank(0, 3, width, rows, "int8")
    banks = jax.tree.map(lambda leaf: np.stack([leaf, leaf]), bank)
    ids = jnp.asarray([[[0, 2]], [[1, -1]]], jnp.int32)
    gates = jnp.full((2, 1, 2), 0.5, jnp.float32)
    x = jnp.ones((2, 1, width), jnp.float32)

    def plan(i, fraction):
        return pc.ensure_hybrid(pc.init(1, 3, 3), 0, i, pc.FetchPolicy.fraction(fraction))[1]

    def cpu(b, i, g, v):
        return pc.cpu_partial(v, i, g, plan(i, 0.0), b, experts.swiglu)

    def device(p, i, g, v):
        return hybrid.device_partial(v, i, g, plan(i, 1.0), p, experts.swiglu)

    size = bank["w1"][0].size
    for fn in (cpu, device):
        hlo = jax.jit(jax.vmap(fn)).lower(banks, ids, gates, x).compile().as_text()
        assert whole_matrix_ops(hlo, size) == [], fn.__name__


# ---- bad banks ----------------------------------------------------------------------------------

def _bad_banks():
    f32 = experts.random_bank(0, E, H, F, "fp32")
    i8 = experts.random_bank(0, E, H, F, "int8")
    i4 = experts.random_bank(0, E, H, F, "int4")
    return {
        "'w1_scale': a scale beside float32": {**f32, "w1_scale": i8["w1_scale"]},
        "'w3_scale' is missing": {k: v for k, v in i8.items() if k != "w3_scale"},
        "'w2_scale' has shape": {**i8, "w2_scale": i8["w1_scale"]},
        "'w1_scale' has shape": {**i4, "w1_scale": i4["w1_scale"][..., :1][..., [0, 0, 0]]},
        "mixed dtypes across leaves: 'w1' is float32 but 'w3' is uint16": {
            **f32, "w3": experts.random_bank(0, E, H, F, "bf16")["w3"]},
        "'w2_scale' has dtype float16": {**i8, "w2_scale": i8["w2_scale"].astype(np.float16)},
        "leaf 'w4'": {**f32, "w4": f32["w1"]},
    }


@pytest.mark.parametrize("case", list(_bad_banks()))
def test_a_bad_bank_is_refused_naming_the_leaf_before_anything_runs(case):
    """FAILS if a bank whose dtype and scales disagree, whose scale has the wrong shape or dtype,
    whose matrices mix dtypes, or that has a leaf no format has, is accepted, or refused without
    naming the leaf, by cpu_partial (at trace time: nothing is copied or computed) or by the
    expert function called on one expert."""
    bank = _bad_banks()[case]
    ids = jnp.asarray([[0, 1]], jnp.int32)
    gates = jnp.ones((1, 2), jnp.float32)
    _, plan = pc.ensure_hybrid(pc.init(1, E, E), 0, ids, pc.FetchPolicy.fraction(0.0))
    x = jnp.ones((1, H), jnp.float32)
    with pytest.raises(ValueError, match=re.escape(case)):
        jax.jit(lambda b: pc.cpu_partial(x, ids, gates, plan, b, experts.swiglu)).lower(bank)
    with pytest.raises(ValueError, match=re.escape(case)):
        experts.swiglu({k: v[0] for k, v in bank.items()}, x[0])


def test_make_bank_refuses_an_odd_int4_width_and_an_unknown_format():
    """FAILS if make_bank packs an odd row width into int4 (the last weight would lose its pair)
    or a group that does not divide the row, or takes a format no expert function reads."""
    odd = {"w1": np.ones((1, 5, 4)), "w3": np.ones((1, 5, 4)), "w2": np.ones((1, 4, 5))}
    with pytest.raises(ValueError, match="'w1': int4 packs two weights per byte"):
        experts.make_bank(odd, "int4")
    even = {"w1": np.ones((1, 96, 4)), "w3": np.ones((1, 96, 4)), "w2": np.ones((1, 4, 96))}
    with pytest.raises(ValueError, match="groups of 128"):
        experts.make_bank(even, "int4")
    for dtype in ("fp8", "mxfp4"):
        with pytest.raises(ValueError, match=f"no expert function reads dtype '{dtype}'"):
            experts.make_bank(even, dtype)
