"""A decode loop with host-resident experts (``ensure_hybrid``, ``apply_copy_plan``,
``moe_hybrid``, one compiled ``lax.scan``): measured ms per token per cache size and policy,
beside the replay's modeled cost, with the loop's counts checked against the replay's."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pallas_cache as pc  # noqa: E402
from hybrid_mechanism import mech_compute_on  # noqa: E402
from pallas_cache import experts  # noqa: E402
from pallas_cache.experts import swiglu  # noqa: E402
from pallas_cache.moe import apply_copy_plan, put_host_bank  # noqa: E402
from pallas_cache.sizing import (  # noqa: E402
    PRESETS, ReplayConfig, Trace, load_trace, parse_policy, replay, synthetic_trace)
from pallas_cache.sizing import cli  # noqa: E402
from pallas_cache.sizing.sweep.cost import CostModel  # noqa: E402
from pallas_cache.sizing.units import format_bandwidth, parse_bandwidth  # noqa: E402
from timing import markdown_table, median_seconds, publish, repeat_seconds, run_header  # noqa: E402

POLICIES = ("full", "fraction:auto", "cap:1")
TIE = 0.05


def make_bank(layers, num_experts, hidden, ffn, seed=0, dtype="bf16"):
    """Random SwiGLU experts ``[L, E]`` in the library's bank format ``dtype``
    (:func:`pallas_cache.experts.random_bank`: one expert's float32 at a time)."""
    return experts.random_bank(seed, num_experts, hidden, ffn, dtype, layers=layers)


def the_trace(args) -> Trace:
    """A dense ``[tokens, layers, top_k]`` trace: the first ``--tokens`` x ``--layers`` of it."""
    if args.trace:
        trace = load_trace(args.trace)
        dense = trace.to_dense()[:args.tokens, :args.layers]
        return Trace.from_dense(dense, num_experts=trace.num_experts,
                                source=f"{trace.source}[:{args.tokens}, :{args.layers}]")
    params = dataclasses.replace(PRESETS["mixtral-realistic"], num_layers=args.layers,
                                 num_tokens=args.tokens)
    trace = synthetic_trace(params, seed=args.seed)
    return Trace.from_dense(trace.to_dense(), num_experts=trace.num_experts,
                            source=f"synthetic:mixtral-realistic(layers={args.layers}, "
                                   f"tokens={args.tokens}, seed={args.seed})")


@jax.jit
def _decode(state, pool, bank, routes, gates, x0, policy):
    """Decode ``routes [T, L, k]`` one token at a time; returns the last hidden state, the
    per-call fetched and CPU-expert counts and the final cache."""
    num_layers = routes.shape[1]

    def token(carry, inputs):
        state, pool = carry
        token_routes, token_gates = inputs

        def layer_step(carry, inputs):
            state, pool, h = carry
            layer, ids, g = inputs
            ids, g = ids[None], g[None]
            state, plan = pc.ensure_hybrid(state, layer, ids, policy)
            pool = apply_copy_plan(pool, bank, plan, layer=layer)
            out = pc.moe_hybrid(h, ids, g, plan, pool, bank, swiglu, layer=layer)
            h = h + out
            h = h / jnp.sqrt(jnp.mean(h * h) + 1e-6)  # keep the residual stream O(1)
            return (state, pool, h), (plan.copy.count, plan.missing - plan.fetched)

        (state, pool, h), counts = lax.scan(
            layer_step, (state, pool, x0),
            (jnp.arange(num_layers, dtype=jnp.int32), token_routes, token_gates))
        return (state, pool), (h, counts)

    (state, pool), (h, (fetched, cpu_experts)) = lax.scan(token, (state, pool), (routes, gates))
    return h, fetched, cpu_experts, state


def _pool(bank, cache_size):
    return {name: jnp.zeros((cache_size,) + leaf.shape[2:], leaf.dtype)
            for name, leaf in bank.items()}


def _primed(bank, host, num_layers, num_experts):
    """A cache of ``S = L*E`` with every expert resident, and its filled pool."""
    state = pc.init(num_layers, num_experts, num_layers * num_experts)
    pool = _pool(bank, num_layers * num_experts)
    for layer in range(num_layers):
        state, plan = pc.ensure(state, layer, jnp.arange(num_experts, dtype=jnp.int32))
        pool = apply_copy_plan(pool, host, plan, layer=layer)
    return state, pool


def time_decode(make_start, host, routes, gates, x0, policy, rounds):
    """Median seconds of one decode from ``make_start()`` (built untimed; a warm-up first), and
    the last decode's outputs."""
    out = []

    def setup():
        return jax.block_until_ready(make_start())

    def run(start):
        out[:] = [jax.block_until_ready(_decode(*start, host, routes, gates, x0, policy))]

    return statistics.median(repeat_seconds(run, rounds, setup=setup)), out[0]


def bench_bandwidth(hidden, ffn, mib, dtype):
    """``pallas-cache bench-bandwidth``'s two figures (bytes per second), B_cpu at the bank's
    ``dtype``."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        status = cli.main(["bench-bandwidth", "--mib", str(mib), "--d-model", str(hidden),
                           "--d-expert", str(ffn), "--repeats", "5", "--dtype", dtype])
    if status:
        raise SystemExit(f"bench-bandwidth failed with status {status}")
    flags = [line for line in text.getvalue().splitlines() if line.startswith("flags:")][0]
    words = flags.split()
    return (parse_bandwidth(words[words.index("--link-bandwidth") + 1]),
            parse_bandwidth(words[words.index("--cpu-bandwidth") + 1]))


def copy_path_seconds(bank, host):
    """``seconds(n, rounds)``: the median seconds of ``apply_copy_plan`` moving ``n`` experts from
    the host bank into a pool inside a compiled program."""
    pool = _pool(bank, 2)
    run = jax.jit(apply_copy_plan, static_argnames=())

    def seconds(n, rounds):
        plan = pc.CopyPlan(dst_slots=jnp.array([0, 1][:n] + [-1] * (2 - n), jnp.int32),
                           src_rows=jnp.array([0, 1][:n] + [-1] * (2 - n), jnp.int32),
                           count=jnp.int32(n))
        return median_seconds(lambda: jax.block_until_ready(run(pool, host, plan, layer=0)),
                              rounds)
    return seconds


#: Seconds a slope measurement may spend on more batches before it reports what it has.
SLOPE_TIME_LIMIT = 120.0


def slope_rate(what, expert_bytes, seconds, rounds, time_limit=SLOPE_TIME_LIMIT):
    """Bytes per second from the slope of 0, 1 and 2 experts: ``seconds(n, rounds)`` is one
    batch's median seconds for ``n`` experts. A loaded machine can swamp one batch (2 experts no
    slower than 0), so batches are added until the medians over the batches give a positive
    slope (and there are at least two, for a spread), or ``time_limit`` seconds have passed.

    Returns:
      ``(rate or None, line)``: the rate from the medians over the batches and a line with the
      batch count and the per-batch rates' range (their spread), or ``None`` and why, when no
      positive slope came within the time limit (the caller then uses another figure).
    """
    start = time.perf_counter()
    batches = []
    while True:
        batches.append([seconds(n, rounds) for n in (0, 1, 2)])
        medians = [statistics.median(batch[n] for batch in batches) for n in range(3)]
        slope = (medians[2] - medians[0]) / 2
        elapsed = time.perf_counter() - start
        if (slope > 0 and len(batches) >= 2) or elapsed > time_limit:
            break
    rates = sorted(expert_bytes * 2 / (b[2] - b[0]) for b in batches if b[2] > b[0])
    spread = (f"per-batch {format_bandwidth(rates[0])} to {format_bandwidth(rates[-1])}"
              if rates else "no batch had a positive slope")
    where = f"{len(batches)} batches of {rounds} rounds in {elapsed:.0f} s; {spread}"
    if slope <= 0:
        return None, (f"{what}: 2 experts took no longer than 0 over {where} (the load swamped "
                      f"the slope)")
    return expert_bytes / slope, f"{what}: {format_bandwidth(expert_bytes / slope)} ({where})"


def relation(a, b):
    """-1, 0 or 1: ``a`` below, within 5% of, or above ``b``."""
    if abs(a - b) <= TIE * max(abs(a), abs(b)):
        return 0
    return -1 if a < b else 1


def orders_agree(measured, modeled):
    """Whether every pair of rows compares the same way in both lists (5% ties)."""
    pairs = [(i, j) for i in range(len(measured)) for j in range(i + 1, len(measured))]
    wrong = [(i, j) for i, j in pairs
             if relation(measured[i], measured[j]) != relation(modeled[i], modeled[j])]
    return not wrong, wrong


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true",
                        help="hidden 1024, ffn 3584 (for a small CPU-only machine)")
    parser.add_argument("--trace", help="a recorded dense trace (default: mixtral-realistic)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sizes", default="8,16,24")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=SLOPE_TIME_LIMIT,
                        help="seconds each bandwidth slope may take more batches of --rounds "
                             f"on a loaded machine before it reports (default: "
                             f"{SLOPE_TIME_LIMIT:g})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mib", type=int, default=256, help="bench-bandwidth's --mib")
    parser.add_argument("--dtype", choices=experts.FORMATS, default=None,
                        help="expert bank format (default: bf16)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    hidden, ffn = (1024, 3584) if args.small else (4096, 14336)
    dtype = args.dtype or "bf16"
    sizes = [int(s) for s in args.sizes.split(",")]
    wall = time.perf_counter()

    trace = the_trace(args)
    L, E, k, T = trace.num_layers, trace.num_experts, trace.top_k, trace.num_tokens
    routes = jnp.asarray(trace.to_dense(), jnp.int32)
    rng = np.random.default_rng(args.seed + 1)
    gates = jnp.asarray(rng.dirichlet(np.ones(k), size=(T, L)).astype(np.float32))
    x0 = jnp.asarray(rng.standard_normal((1, hidden), np.float32))
    bank = make_bank(L, E, hidden, ffn, args.seed, dtype)
    host = put_host_bank(bank)
    expert_bytes = sum(leaf[0, 0].nbytes for leaf in bank.values())
    placement = jax.tree.leaves(host)[0].sharding.memory_kind
    print(f"trace {trace.source}: L={L} E={E} top-{k} T={T}; expert {expert_bytes / 2**20:.1f} "
          f"MiB {dtype}, bank in {placement!r} memory", flush=True)

    link, bench_cpu = bench_bandwidth(hidden, ffn, args.mib, dtype)
    one_layer = {n: v[:1] for n, v in bank.items()}
    path_cpu, cpu_line = slope_rate(
        "cpu_partial", expert_bytes,
        lambda n, rounds: mech_compute_on(one_layer, x0, jnp.full((1, 2), 0.5), 1, n, rounds),
        2 * args.rounds + 1, args.time_limit)
    copy_link, copy_line = slope_rate("the copy path (apply_copy_plan)", expert_bytes,
                                      copy_path_seconds(bank, host), 2 * args.rounds + 1,
                                      args.time_limit)
    print(cpu_line, flush=True)
    print(copy_line, flush=True)
    if path_cpu is None:
        path_cpu = bench_cpu
        cpu_line += "; B_cpu is bench-bandwidth's figure instead"
    if copy_link is None:
        copy_link = link
        copy_line += "; the copy-path model column uses bench-bandwidth's B_link instead"
    cost = CostModel(expert_bytes=expert_bytes, link_bandwidth=link, cpu_bandwidth=path_cpu)
    copy_cost = CostModel(expert_bytes=expert_bytes, link_bandwidth=copy_link,
                          cpu_bandwidth=path_cpu)
    policies = [cost.auto_policy() if p == "fraction:auto" else p for p in POLICIES]
    print(f"B_link {format_bandwidth(link)} (bench-bandwidth); B_cpu {format_bandwidth(path_cpu)} "
          f"(cpu_partial) vs {format_bandwidth(bench_cpu)} (bench-bandwidth); "
          f"fraction:auto = {policies[1]}", flush=True)

    configs = [ReplayConfig(s, p) for s in sizes for p in policies]
    modeled = replay(trace, configs, bounds=False, cost=cost, progress=lambda s: None)

    with jax.default_matmul_precision("highest"):
        base_seconds, (h_base, *_rest) = time_decode(
            lambda: _primed(bank, host, L, E), host, routes, gates, x0, pc.FetchPolicy.full(),
            args.rounds)
        base = base_seconds * 1e3 / T
        print(f"resident (S={L * E}): {base:.2f} ms/token", flush=True)
        rows = []
        for config, result in zip(configs, modeled):
            seconds, (h, fetched, cpu, _) = time_decode(
                lambda: (pc.init(L, E, config.cache_size), _pool(bank, config.cache_size)),
                host, routes, gates, x0, parse_policy(config.policy), args.rounds)
            if (int(fetched.sum()), int(cpu.sum())) != (result.fetched, result.cpu_experts):
                raise SystemExit(f"{config}: the loop fetched {int(fetched.sum())} and ran "
                                 f"{int(cpu.sum())} CPU experts, the replay "
                                 f"{result.fetched} and {result.cpu_experts}")
            ms = seconds * 1e3 / T
            rows.append(dict(size=config.cache_size, policy=config.policy, measured=ms,
                             overhead=ms - base, modeled=result.modeled_ms_per_token,
                             modeled_copy=copy_cost.seconds(result.pair_counts) * 1e3 / T,
                             fetched=result.fetched_per_token,
                             cpu=result.cpu_experts_per_token,
                             diff=float(jnp.max(jnp.abs(h - h_base)))))
            r = rows[-1]
            print(f"S={r['size']:3d} {r['policy']:>16}: measured {ms:8.2f} ms/token, overhead "
                  f"{r['overhead']:8.2f}, modeled {r['modeled']:8.2f}; fetched/token "
                  f"{r['fetched']:.2f}, cpu experts/token {r['cpu']:.2f}", flush=True)

    verdicts = {}
    for size in sizes:
        group = [r for r in rows if r["size"] == size]
        verdicts[size] = (orders_agree([r["overhead"] for r in group],
                                       [r["modeled"] for r in group]),
                          orders_agree([r["overhead"] for r in group],
                                       [r["modeled_copy"] for r in group]))
    elapsed = time.perf_counter() - wall

    synthetic = trace.source.startswith("synthetic")
    command = "python benchmarks/hybrid_decode.py" + (" --small" if args.small else "") + \
        (f" --dtype {args.dtype}" if args.dtype else "") + \
        (f" --trace {args.trace}" if args.trace else "") + f" --rounds {args.rounds}"
    lines = [
        f"## Hybrid decode: measured vs modeled ms per token (`benchmarks/hybrid_decode.py"
        f"{' --small' if args.small else ''}`)",
        "",
        run_header(command, note=f", {elapsed:.0f} s") + f" Host bank in `{placement}` memory.",
        "",
        f"Trace: `{trace.source}`{' (**synthetic**)' if synthetic else ''}; L={L}, E={E}, "
        f"top-{k}, {T} tokens, one token per step. Experts: SwiGLU, hidden {hidden}, ffn {ffn}, "
        f"{dtype}, W = {expert_bytes / 2**20:.1f} MiB. `B_link` = {format_bandwidth(link)} "
        f"(`pallas-cache bench-bandwidth --mib {args.mib}`); `B_cpu` = "
        f"{format_bandwidth(path_cpu)} measured on `cpu_partial` (bench-bandwidth's figure: "
        f"{format_bandwidth(bench_cpu)}); `fraction:auto` = `{policies[1]}`. The copy path "
        f"itself (`apply_copy_plan` in a compiled call) moves {format_bandwidth(copy_link)}: "
        f"the last model column uses it as `B_link`. Slopes: {cpu_line}; {copy_line}. Every "
        f"expert "
        f"resident (S = {L * E}): {base:.2f} ms/token. Measured: median of {args.rounds} "
        f"decodes after a warm-up, each from a cold cache. Fetched and CPU-expert counts equal "
        f"the replay's in every row.",
        "",
        markdown_table(
            ["S", "policy", "fetched/token", "CPU experts/token", "measured ms/token",
             "overhead ms/token", "modeled ms/token", "overhead / modeled",
             "modeled, copy-path B_link", "overhead / that", "max abs diff vs resident"],
            [[r["size"], f"`{r['policy']}`", f"{r['fetched']:.2f}", f"{r['cpu']:.2f}",
              f"{r['measured']:.2f}", f"{r['overhead']:.2f}", f"{r['modeled']:.2f}",
              f"{r['overhead'] / r['modeled']:.2f}" if r["modeled"] > 0 else "-",
              f"{r['modeled_copy']:.2f}",
              f"{r['overhead'] / r['modeled_copy']:.2f}" if r["modeled_copy"] > 0 else "-",
              f"{r['diff']:.1e}"] for r in rows]),
    ]
    lines.append("")
    for size, checks in verdicts.items():
        group = [r for r in rows if r["size"] == size]
        words = []
        for name, (agree, wrong) in zip(("bench-bandwidth B_link", "copy-path B_link"), checks):
            detail = "" if agree else " (" + ", ".join(
                f"`{group[i]['policy']}` vs `{group[j]['policy']}`" for i, j in wrong) + ")"
            words.append(f"with {name} the model "
                         f"{'orders the policies as measured' if agree else 'misorders'}{detail}")
        lines.append(f"- S = {size}: " + "; ".join(words) + ".")
    text = "\n".join(lines)
    publish("hybrid_decode_small" if args.small else "hybrid_decode", text, not args.no_write)


if __name__ == "__main__":
    main()
