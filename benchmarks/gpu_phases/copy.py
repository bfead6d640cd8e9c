"""Phase ``copy``: what the copy path moves. ``apply_copy_plan`` (jitted, the pool donated)
copies m expert rows of a bank held in ``pinned_host`` memory (``put_host_bank``; device memory
where the backend has no such kind, said in the table) into a device pool: GB/s from the wall
time (median of ``--repeats`` calls) and from the device time (the sum of the GPU events of one
profiled call: the host-to-device copies and the scatter), and the copied rows checked against
the bank's."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_cache as pc
from pallas_cache.moe import host_memory_kind

from .common import cell, device_times, log, profile_options

NAME = "copy"
ROWS = ((4, 1), (4, 8), (64, 1), (64, 8))  # (MiB per expert row, experts copied)
SMOKE_ROWS = ((1 / 16, 1), (1 / 16, 8))
SLOTS = 8  # pool slots and bank rows
ESTIMATE_S = {"row": 2.5}

_COPY = jax.jit(pc.apply_copy_plan, donate_argnums=0)


def plan(args):
    return [({"mib": mib, "m": m, "label": f"{mib:g} MiB rows, {m} copied"}, ESTIMATE_S["row"])
            for mib, m in (SMOKE_ROWS if args.smoke else ROWS)]


_BANKS: dict = {}


def _bank(width):
    if width not in _BANKS:
        host = np.arange(SLOTS * width, dtype=np.float32).reshape(SLOTS, width)
        _BANKS.clear()  # one bank at a time: the 64 MiB rows take 512 MiB of pinned memory
        _BANKS[width] = (pc.put_host_bank(host), host)
    return _BANKS[width]


def run(ctx, row) -> dict:
    args = ctx.args
    width = int(row["mib"] * 2**20) // 4
    m = row["m"]
    bank, host = _bank(width)
    order = np.random.default_rng(args.seed + m).permutation(SLOTS)
    plan = pc.CopyPlan(dst_slots=jnp.asarray(order, jnp.int32),
                       src_rows=jnp.asarray(order[::-1].copy(), jnp.int32),
                       count=jnp.int32(m))
    pool = jnp.zeros((SLOTS, width), jnp.float32)
    pool = jax.block_until_ready(_COPY(pool, bank, plan))  # compile and warm up
    samples = []
    for _ in range(max(args.repeats, 3)):
        t0 = time.perf_counter()
        pool = jax.block_until_ready(_COPY(pool, bank, plan))
        samples.append(time.perf_counter() - t0)
    state = {"pool": pool}
    options = profile_options(args)
    profiled = _COPY if options is None else _COPY.lower(pool, bank, plan).compile(
        compiler_options=options)

    def once():
        state["pool"] = profiled(state["pool"], bank, plan)
        return state["pool"]
    sums, note = device_times([once])
    got = np.asarray(jax.device_get(state["pool"]))
    ok = all(np.array_equal(got[order[i]], host[order[::-1][i]]) for i in range(m))
    moved = m * width * 4
    out = {"status": "match" if ok else "MISMATCH", "kind": host_memory_kind() or "device",
           "wall_gbs": moved / statistics.median(samples) / 1e9,
           "device_gbs": moved / (sums[0] * 1e-6) / 1e9 if sums else None,
           "device_us": sums[0] if sums else None, "device_note": note}
    if not ok:
        ctx.fail(f"MISMATCH [copy {row['label']}]: a copied pool row differs from its bank row")
    log(f"copy [{row['label']}]: {out['wall_gbs']:.2f} GB/s wall, "
        f"{cell(out['device_gbs'])} GB/s device ({out['kind']} bank); {out['status']}")
    return out


def markdown(args, done) -> list[str]:
    lines = ["Copy path: `apply_copy_plan` (jitted, pool donated) from a `put_host_bank` bank "
             f"of {SLOTS} rows into a {SLOTS}-slot pool; GB/s = bytes copied / time (wall: "
             "median call; device: the GPU events of one profiled call).", "",
             "| row MiB | experts copied | bank memory | wall GB/s | device GB/s | device us | "
             "status |", "|---:|---:|---|---:|---:|---:|---|"]
    for row, r in done:
        if "wall_gbs" not in r:
            lines.append(f"| {row['mib']:g} | {row['m']} | | | | | {r['status']} |")
            continue
        lines.append(f"| {row['mib']:g} | {row['m']} | {r['kind']} | {r['wall_gbs']:.2f} | "
                     f"{cell(r['device_gbs'])} | {cell(r['device_us'], '{:.1f}')} | "
                     f"{r['status']} |")
    return lines
