"""An offloaded decode at a model's expert geometry, measured beside the replay's model.

:func:`bench_decode` decodes a routing trace one token at a time through one compiled program
(``ensure_hybrid``, ``apply_copy_plan``, ``moe_hybrid`` in a ``lax.scan`` over layers inside one
over tokens) with random expert weights in host memory, for each row a user compares: every
expert resident (the floor), no cache (each call copies its routed experts), and cache
configurations. Each row's per-call ``(hits, fetched, cpu_experts)`` counts are checked equal to
the replay's on the same routes, and each row is timed beside the replay's event-rule time
(``overlap_ms_per_token``, docs/semantics.md §11.6) with the parameters measured in the same run
(:func:`measure_parameters`). ``pallas-cache bench-decode`` is its command line;
``benchmarks/hybrid_decode.py`` calls it too.

Each layer is the MoE block alone: attention, dense layers and the LM head are not run, the
router is the trace's routes (gates random), and a norm keeps the residual stream O(1).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import statistics
import time
from types import SimpleNamespace
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_cache as pc
from pallas_cache import experts
from pallas_cache.formats import int4_groups
from pallas_cache.hybrid import device_partial
from pallas_cache.moe import apply_copy_plan, put_host_bank
from pallas_cache.sizing.sweep import ReplayConfig, parse_policy, replay
from pallas_cache.sizing.sweep.cost import CostModel, overlap_times
from pallas_cache.sizing.traces import Trace
from pallas_cache.sizing.units import format_bandwidth

__all__ = ["ATTENTION_LINE", "DecodeRun", "Geometry", "Parameters", "Row",
           "RowSpec", "bench_decode", "check_expert_dtype", "gap_line", "slope_rate"]

#: What the decode leaves out, said once wherever its numbers are shown.
ATTENTION_LINE = ("each layer is its MoE block alone: no attention, dense layers or LM head; the "
                  "router is the trace's routes (random gates)")

#: Seconds a slope measurement may spend on more batches before it reports what it has.
SLOPE_TIME_LIMIT = 120.0


def check_expert_dtype(dtype: str) -> None:
    """Raise ``ValueError`` for a dtype no expert function of :mod:`pallas_cache.experts` reads
    (one line, for the CLI)."""
    if dtype not in experts.FORMATS:
        raise ValueError(f"no expert function for {dtype} (bench-decode runs the library's "
                         f"expert formats: {', '.join(experts.FORMATS)})")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The decode's shape.

    Attributes:
      num_layers / num_experts / top_k: ``L``, ``E`` and routes per layer-call.
      d_model / d_expert: one SwiGLU expert's three matrices, each stored as ``d_expert`` rows of
        ``d_model`` weights (:mod:`pallas_cache.experts`' layout).
      dtype: the bank's format, one of ``pallas_cache.experts.FORMATS``.
    """

    num_layers: int
    num_experts: int
    top_k: int
    d_model: int
    d_expert: int
    dtype: str

    @property
    def expert_bytes(self) -> int:
        """``W``: one expert's three matrices as the bank stores them, scales included
        (:func:`pallas_cache.experts.bytes_per_expert`)."""
        return experts.bytes_per_expert(self.d_model, self.d_expert, self.dtype)

    @property
    def resident_slots(self) -> int:
        """``L * E``: the pool of the floor row."""
        return self.num_layers * self.num_experts


#: The symmetric codes of each quantized format: ``2 m + 1`` levels ``-m .. m``.
_LEVELS = {"int8": 255, "int4": 15}


def _expert_fn_and_bank(geometry: Geometry, *, seed: int = 0, device=None,
                        progress: Callable[[str], None] = lambda line: None):
    """``(expert_fn, host_bank)``: :data:`pallas_cache.experts.swiglu` and a bank of random
    weights in the experts' layout of ``geometry.dtype`` (``w1, w3, w2: [L, E, F, H]``; bf16 as
    uint16 bits, int8 codes with float32 ``<matrix>_scale`` per output channel, int4 packed
    ``[L, E, F, H / 2]`` with ``[L, E, F, groups]`` scales), made a leaf at a time on the device
    and moved into host memory (``put_host_bank``), so neither NumPy nor the device ever holds
    more than one leaf."""
    check_expert_dtype(geometry.dtype)
    g = geometry
    device = jax.devices()[0] if device is None else device
    lead = (g.num_layers, g.num_experts)
    shape = lead + (g.d_expert, g.d_model)
    leaves = []
    for index, name in enumerate(("w1", "w3", "w2")):
        fan_in = g.d_expert if name == "w2" else g.d_model
        leaves.append((name, functools.partial(_random_leaf, shape=shape, fmt=g.dtype,
                                               fan_in=fan_in, seed=3 * seed + index)))
        if g.dtype in _LEVELS:
            scale_shape = lead + ((g.d_model if name == "w2" else g.d_expert,) if g.dtype == "int8"
                                  else (g.d_expert, int4_groups(g.d_model)))
            value = math.sqrt(12.0 / fan_in / (_LEVELS[g.dtype] ** 2 - 1))  # variance 1/fan_in
            leaves.append((f"{name}_scale", functools.partial(jnp.full, scale_shape, value,
                                                              jnp.float32)))
    bank = {}
    for name, make in leaves:
        leaf = jax.jit(make, out_shardings=_device_sharding(device))()
        progress(f"bank leaf {name} {list(leaf.shape)} {leaf.dtype} ({g.dtype})")
        bank[name] = put_host_bank(leaf, device)
        if bank[name] is not leaf:
            leaf.delete()
    return experts.swiglu, bank


def _device_sharding(device):
    """A one-device sharding in the device's default memory (jax 0.12 renamed the class's
    constructor)."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def _random_leaf(shape, fmt, fan_in, seed):
    """One stored matrix ``[L, E, F, H]`` of format ``fmt``: uniform weights of variance
    ``1 / fan_in`` (quantized: uniform codes ``-m .. m`` of :data:`_LEVELS`, whose scale leaf
    gives that variance), from a hash of each stored element's (layer, expert) and its index
    inside the expert, elementwise (one fused loop, no draw of float32 first). int4 takes two
    codes from each byte's hash, the even weight in the low nibble."""
    def mix(x):
        x = x ^ (x >> 16)
        x = x * jnp.uint32(0x7FEB352D)
        x = x ^ (x >> 15)
        x = x * jnp.uint32(0x846CA68B)
        return x ^ (x >> 16)

    stored = shape[:-1] + (shape[-1] // 2,) if fmt == "int4" else shape
    iota = functools.partial(lax.broadcasted_iota, jnp.uint32, stored)
    expert = iota(0) * jnp.uint32(stored[1]) + iota(1) + jnp.uint32(seed * 0x9E3779B9 % 2**32)
    inner = iota(2) * jnp.uint32(stored[3]) + iota(3)
    bits = mix(mix(expert) + inner)

    def unit(shift, width):  # [-0.5, 0.5) from ``width`` bits of the hash: variance 1/12
        return ((bits >> shift) & jnp.uint32(2**width - 1)).astype(jnp.float32) / 2**width - 0.5

    if fmt not in _LEVELS:
        weights = unit(8, 24) * math.sqrt(12.0 / fan_in)
        if fmt == "bf16":  # the bits, as the experts' banks store them
            return lax.bitcast_convert_type(weights.astype(jnp.bfloat16), jnp.uint16)
        return weights
    levels = _LEVELS[fmt]

    def codes(shift, width):
        return jnp.floor(unit(shift, width) * levels + 0.5).astype(jnp.int32)  # -m .. m

    if fmt == "int8":
        return codes(8, 24).astype(jnp.int8)
    low, high = codes(8, 12), codes(20, 12)
    return ((low & 0xF) | ((high & 0xF) << 4)).astype(jnp.uint8)


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


@dataclasses.dataclass(frozen=True)
class Parameters:
    """The model's parameters, measured in the run.

    Attributes:
      copy_bandwidth: ``B_link``, bytes per second ``apply_copy_plan`` moves (every byte moved
        counted) inside a compiled call.
      cpu_bandwidth: ``B_cpu``, expert bytes per second of ``cpu_partial`` at the bank's dtype.
      cpu_fixed_seconds: ``T_cpu``, what a call with CPU experts adds beyond its experts.
      gpu_layer_seconds: ``A``, one layer-call of the decode with no routes (the cache step,
        both partials' empty branches, the norm).
      gpu_expert_seconds: ``C``, one more distinct expert in ``device_partial``.
      lines: how each was measured, one line each.
    """

    copy_bandwidth: float
    cpu_bandwidth: float
    cpu_fixed_seconds: float
    gpu_layer_seconds: float
    gpu_expert_seconds: float
    lines: tuple = ()

    #: The fields the gap line may name, with their labels.
    NAMES = {"copy_bandwidth": "B_link (copy path)", "cpu_bandwidth": "B_cpu (cpu_partial)",
             "cpu_fixed_seconds": "T_cpu", "gpu_layer_seconds": "A (layer outside experts)",
             "gpu_expert_seconds": "C (per device expert)"}

    def cost(self, expert_bytes: int) -> CostModel:
        """The replay's cost model with these parameters."""
        return CostModel(expert_bytes=expert_bytes, link_bandwidth=self.copy_bandwidth,
                         cpu_bandwidth=self.cpu_bandwidth,
                         cpu_fixed_seconds=self.cpu_fixed_seconds,
                         gpu_layer_seconds=self.gpu_layer_seconds,
                         gpu_expert_seconds=self.gpu_expert_seconds)

    def ms_per_token(self, call_counts, expert_bytes: int, tokens: int) -> float:
        """The event rules' time per token over ``(hits, fetched, cpu_experts, calls)``."""
        times = overlap_times(call_counts, expert_bytes, self.copy_bandwidth, self.cpu_bandwidth,
                              self.cpu_fixed_seconds, self.gpu_layer_seconds,
                              self.gpu_expert_seconds)
        return 1e3 * times.total / max(tokens, 1)


@dataclasses.dataclass(frozen=True)
class Row:
    """One decoded row, measured and modeled (the keys of ``--format json``)."""

    row: str
    kind: str
    cache_size: int
    policy: str
    eviction: str
    measured_ms_per_token: float
    tokens_per_second: float
    fetched_per_token: float
    cpu_experts_per_token: float
    compile_seconds: float
    modeled_ms_per_token: float
    measured_over_modeled: float
    counts_checked_against: str
    call_counts: tuple = ()

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["call_counts"] = [list(c) for c in self.call_counts]
        return out


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """What :func:`bench_decode` measured: the rows, the parameters, the notes to print."""

    geometry: Geometry
    trace_source: str
    tokens: int
    bank_memory: str | None
    rows: tuple
    parameters: Parameters
    notes: tuple
    gaps: tuple


def slope_rate(what, expert_bytes, seconds, rounds, time_limit=SLOPE_TIME_LIMIT,
               counts=(0, 1, 2)):
    """Bytes per second from the slope of ``counts`` experts: ``seconds(n, rounds)`` is one
    batch's median seconds for ``n`` experts. A loaded machine can swamp one batch (the most
    experts no slower than the fewest), so batches are added until the medians over the batches
    give a positive slope (and there are at least two, for a spread), or ``time_limit`` seconds
    have passed.

    Returns:
      ``(rate, line)``: the rate from the medians over the batches and a line with the batch
      count and the per-batch rates' range; or ``None`` and why, when no positive slope came
      within the time limit (the caller then uses another figure).
    """
    rate, line, _ = _slope(what, expert_bytes, seconds, rounds, time_limit, counts)
    return rate, line


def _slope(what, expert_bytes, seconds, rounds, time_limit, counts):
    """:func:`slope_rate` with the medians over the batches, one per count."""
    start = time.perf_counter()
    batches = []
    span = counts[-1] - counts[0]
    while True:
        batches.append([seconds(n, rounds) for n in counts])
        medians = [statistics.median(batch[i] for batch in batches) for i in range(len(counts))]
        slope = (medians[-1] - medians[0]) / span
        elapsed = time.perf_counter() - start
        if (slope > 0 and len(batches) >= 2) or elapsed > time_limit:
            break
    rates = sorted(expert_bytes * span / (b[-1] - b[0]) for b in batches if b[-1] > b[0])
    spread = (f"per-batch {format_bandwidth(rates[0])} to {format_bandwidth(rates[-1])}"
              if rates else "no batch had a positive slope")
    where = f"{len(batches)} batches of {rounds} rounds in {elapsed:.0f} s; {spread}"
    if slope <= 0:
        return None, (f"{what}: {counts[-1]} experts took no longer than {counts[0]} over "
                      f"{where} (the load swamped the slope)"), medians
    return (expert_bytes / slope, f"{what}: {format_bandwidth(expert_bytes / slope)} ({where})",
            medians)


def _median_seconds(run, rounds, setup=None, warmup=1):
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


class _Decoder:
    """The bank, the routes and the compiled decodes of one run (one program per eviction and
    pool size; the policy and the no-cache flag are traced)."""

    def __init__(self, geometry: Geometry, routes: np.ndarray, seed: int, progress):
        g = geometry
        self.geometry, self.progress = g, progress
        self.device = jax.devices()[0]
        self.expert_fn, self.bank = _expert_fn_and_bank(g, seed=seed, device=self.device,
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

        seconds = _median_seconds(run, repeats, setup=lambda: jax.block_until_ready(
            self.start(spec)))
        counts = tuple(np.asarray(c) for c in out[0])
        out.clear()
        return seconds, compile_seconds, counts


def call_histogram(hits, fetched, cpu) -> tuple:
    """``((hits, fetched, cpu_experts, calls), ...)`` sorted, from per-call count arrays."""
    counter = collections.Counter(zip(np.ravel(hits).tolist(), np.ravel(fetched).tolist(),
                                      np.ravel(cpu).tolist()))
    return tuple(sorted((h, f, c, n) for (h, f, c), n in counter.items()))


def distinct_per_call(routes: np.ndarray) -> np.ndarray:
    """int ``[T, L]``: the distinct non-padding experts of each call of ``routes [T, L, k]``."""
    routes = np.asarray(routes)
    ordered = np.sort(routes, axis=-1)
    new = np.concatenate([np.ones(ordered.shape[:-1] + (1,), bool),
                          ordered[..., 1:] != ordered[..., :-1]], axis=-1)
    return np.sum(new & (ordered >= 0), axis=-1)


def measure_parameters(decoder: _Decoder, spec: RowSpec, rounds: int, time_limit: float,
                       progress) -> Parameters:
    """``B_link``, ``B_cpu``, ``T_cpu``, ``A`` and ``C`` (see :class:`Parameters`), each from
    compiled calls at the bank's geometry and dtype, in this process. ``spec``: the cache whose
    decode, with every route padding, gives ``A``."""
    g, bank, x0 = decoder.geometry, decoder.bank, decoder.x0
    width = g.expert_bytes
    # Up to a call's most distinct experts, K' = min(k, E): the plans and branches the decode runs
    # (XLA:CPU copies 3 or more host rows in a loop that 1 or 2 never enter: measured, the slope
    # of 1 to 3 rows was 10x that of 1 to 2).
    most = max(2, min(g.top_k, g.num_experts))
    lines = []

    progress(f"B_link: apply_copy_plan moving 1 to {most} experts per compiled call")
    copy = jax.jit(apply_copy_plan, donate_argnums=0)

    pools = [decoder.pool(g.num_experts)]  # one pool, written in place call after call, as a decode's

    def copy_seconds(n, rounds):
        plan = pc.CopyPlan(dst_slots=jnp.arange(n, dtype=jnp.int32),
                           src_rows=jnp.arange(n, dtype=jnp.int32), count=jnp.int32(n))

        def run():
            pools[0] = jax.block_until_ready(copy(pools[0], bank, plan, layer=jnp.int32(0)))

        return _median_seconds(run, rounds)

    link, line, copy_medians = _slope("the copy path (apply_copy_plan, bytes moved)", width,
                                      copy_seconds, rounds, time_limit, counts=(1, most))
    lines.append(line)
    if link is None:  # the load swamped the slope: the whole time of one expert stands in
        link = width / max(copy_medians[0], 1e-9)
        lines.append(f"B_link: {format_bandwidth(link)}, one expert's whole copy time instead")

    progress(f"B_cpu, T_cpu: cpu_partial with 0 to {most} CPU experts of one token, {g.dtype}")
    ids = jnp.arange(most, dtype=jnp.int32)[None]
    gates = jnp.full((1, most), 1.0 / most, jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def cpu_call(n, x, bank):
        plan = SimpleNamespace(cpu=jnp.arange(most)[None] < n,
                               copy=SimpleNamespace(num_experts=g.num_experts))
        return pc.cpu_partial(x, ids, gates, plan, bank, decoder.expert_fn, layer=jnp.int32(0))

    def cpu_seconds(n, rounds):
        return _median_seconds(lambda: jax.block_until_ready(cpu_call(n, x0, bank)), rounds)

    cpu, line, medians = _slope("cpu_partial", width, cpu_seconds, rounds, time_limit,
                                counts=tuple(range(most + 1)))
    lines.append(line)
    if cpu is None:
        cpu = most * width / max(medians[-1], 1e-9)
        lines.append(f"B_cpu: {format_bandwidth(cpu)}, {most} experts' whole time instead")
    per_cpu = (medians[-1] - medians[1]) / (most - 1) if most > 1 else 0.0
    fixed = max(0.0, medians[1] - per_cpu - medians[0])

    progress(f"C: device_partial with 0 to {most} resident experts of one token")
    resident = pc.CopyPlan(dst_slots=jnp.arange(most, dtype=jnp.int32),
                           src_rows=jnp.arange(most, dtype=jnp.int32), count=jnp.int32(most))
    pool = jax.jit(apply_copy_plan)(decoder.pool(most), bank, resident, layer=jnp.int32(0))

    @functools.partial(jax.jit, static_argnums=0)
    def device_call(n, x, pool):
        plan = SimpleNamespace(slots=jnp.where(jnp.arange(most) < n, jnp.arange(most), -1)[None],
                               copy=SimpleNamespace(num_slots=most, num_experts=g.num_experts))
        return device_partial(x, ids, gates, plan, pool, decoder.expert_fn)

    def device_seconds(n, rounds):
        return _median_seconds(lambda: jax.block_until_ready(device_call(n, x0, pool)), rounds)

    rate, line, _ = _slope("device_partial", width, device_seconds, rounds, time_limit,
                           counts=tuple(range(most + 1)))
    per_device = width / rate if rate else 0.0
    lines.append(line.replace("device_partial: ", "device_partial: W / ", 1))

    progress(f"A: the decode of {spec.label} with every route padding")
    empty = jnp.full_like(decoder.routes, -1)
    seconds, _, _ = decoder.run(spec, "full", rounds, routes=empty)
    calls = g.num_layers * decoder.routes.shape[0]
    layer = seconds / calls
    lines.append(f"A: {layer * 1e3:.4g} ms per layer-call ({spec.label}'s decode with no routes, "
                 f"median of {rounds})")
    return Parameters(link, cpu, fixed, layer, per_device, tuple(lines))


def gap_line(row: Row, params: Parameters, call_counts, expert_bytes: int, tokens: int,
             threshold: float = 0.15) -> str | None:
    """A line naming the one parameter that, scaled alone, closes ``row``'s gap with the
    smallest change (``None`` within ``threshold``)."""
    if abs(row.measured_over_modeled - 1.0) <= threshold:
        return None
    target = row.measured_ms_per_token
    best = None
    for name in Parameters.NAMES:
        value = getattr(params, name)
        if not value:
            continue
        scale = _closing_scale(lambda s: _with(params, name, value * s).ms_per_token(
            call_counts, expert_bytes, tokens), target)
        if scale is not None and (best is None or abs(math.log(scale)) < abs(math.log(best[1]))):
            best = (name, scale)
    ratio = f"measured/modeled {row.measured_over_modeled:.2f}"
    if best is None:
        return f"{row.row}: {ratio}; no single parameter closes the gap"
    name, scale = best
    value = getattr(params, name)
    shown = (lambda v: format_bandwidth(v)) if "bandwidth" in name else (
        lambda v: f"{v * 1e3:.4g} ms")
    return (f"{row.row}: {ratio}; {Parameters.NAMES[name]} explains most of it: the model "
            f"matches with {shown(value * scale)} instead of {shown(value)} (x{scale:.3g})")


def _with(params: Parameters, name: str, value: float) -> Parameters:
    """``params`` with one field changed."""
    return dataclasses.replace(params, **{name: value})


def _closing_scale(model, target, low=1e-4, high=1e4, steps=80):
    """The scale ``s`` in ``[low, high]`` with ``model(s) == target`` (``model`` monotone in
    ``s``), by bisection on ``log s``; ``None`` if the target is outside its range there."""
    a, b = model(low), model(high)
    if not min(a, b) <= target <= max(a, b) or a == b:
        return None
    lo, hi = math.log(low), math.log(high)
    rising = b > a
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (model(math.exp(mid)) < target) == rising:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def bench_decode(geometry: Geometry, trace: Trace, cache_sizes: Sequence[int],
                 configurations: Sequence[tuple[str, str]], *, repeats: int = 3,
                 rounds: int = 5, time_limit: float = SLOPE_TIME_LIMIT, seed: int = 0,
                 resident: bool = True, no_cache: bool = True,
                 progress: Callable[[str], None] = lambda line: None) -> DecodeRun:
    """Decode ``trace`` (dense, ``[T, L, k]`` of ``geometry``) for every row and model each.

    Rows: the floor (``resident``), no cache (``no_cache``), then every cache size x
    ``(policy, eviction)`` of ``configurations`` (``fraction:auto`` resolved by the measured
    bandwidths). Raises ``RuntimeError`` when a row's per-call counts differ from the replay's
    (or, for the floor and no-cache rows, from the trace's distinct experts per call).
    """
    g = geometry
    routes = trace.to_dense()
    tokens = routes.shape[0]
    decoder = _Decoder(g, routes, seed, progress)
    placement = jax.tree.leaves(decoder.bank)[0].sharding.memory_kind
    width = g.expert_bytes
    specs = []
    if resident:
        specs.append(RowSpec("resident", g.resident_slots))
    if no_cache:
        specs.append(RowSpec("no-cache", g.num_experts))
    smallest = RowSpec("cache", min(cache_sizes) if cache_sizes else g.num_experts)
    params = measure_parameters(decoder, smallest, rounds, time_limit, progress)
    cost = params.cost(width)
    configs = [ReplayConfig(size, cost.auto_policy(g.top_k) if policy == "fraction:auto"
                            else policy, eviction=eviction)
               for size in cache_sizes for policy, eviction in configurations]
    progress(f"replay of {len(configs)} configurations with the measured parameters")
    modeled = replay(trace, configs, bounds=False, cost=cost, progress=lambda line: None,
                     hit_counts=True) if configs else []
    distinct = distinct_per_call(routes)
    zeros = np.zeros_like(distinct)
    expected = {"resident": call_histogram(distinct, zeros, zeros),
                "no-cache": call_histogram(zeros, distinct, zeros)}
    rows, skipped = [], []
    for spec, result in [(s, None) for s in specs] + [
            (RowSpec("cache", c.cache_size, c.policy, c.eviction), r)
            for c, r in zip(configs, modeled)]:
        progress(f"decode {spec.label}: {tokens} tokens, a warm-up and {repeats} repeats")
        try:
            seconds, compile_seconds, (hits, fetched, cpu) = decoder.run(spec, spec.policy,
                                                                         repeats)
        except jax.errors.JaxRuntimeError as error:
            if not _out_of_memory(error):
                raise
            skipped.append(f"{spec.label} did not fit the device's memory: "
                           f"{str(error).splitlines()[0][:160]}")
            progress(skipped[-1])
            decoder.programs.clear()  # what the failed program held goes with it
            continue
        got = call_histogram(hits, fetched, cpu)
        want = expected[spec.kind] if result is None else tuple(
            tuple(c) for c in sorted(result.call_counts))
        against = ("the trace's distinct experts per call" if result is None else
                   "the replay's")
        if got != want:
            raise RuntimeError(f"{spec.label}: the decode's per-call (hits, fetched, "
                               f"cpu_experts, calls) {got} differ from {against} {want}")
        ms = seconds * 1e3 / tokens
        model = (params.ms_per_token(want, width, tokens) if result is None
                 else result.overlap_ms_per_token)
        rows.append(Row(spec.label, spec.kind, spec.cache_size, spec.policy, spec.eviction, ms,
                        1e3 / ms, int(fetched.sum()) / tokens, int(cpu.sum()) / tokens,
                        compile_seconds, model, ms / model if model else math.inf, against,
                        want))
        progress(f"{spec.label}: {ms:.3f} ms/token measured, {model:.3f} modeled")
    gaps = tuple(line for line in (gap_line(r, params, r.call_counts, width, tokens)
                                   for r in rows) if line)
    notes = (ATTENTION_LINE,
             "the no-cache row is modeled as every call copying each of its distinct routed "
             "experts (no hits, no CPU experts); the floor as every call's experts resident "
             "(hits only); the others by the replay's timed model (overlap_ms_per_token)")
    return DecodeRun(g, trace.source, tokens, placement, tuple(rows), params,
                     notes + tuple(skipped), gaps)


def _out_of_memory(error: Exception) -> bool:
    """Whether an XLA runtime error is an allocation that failed (the row is left out)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
