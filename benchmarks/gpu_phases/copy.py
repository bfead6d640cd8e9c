"""Phase ``copy``: what the copy path moves. ``apply_copy_plan`` (jitted, the pool donated)
runs a plan of 8 entries of which m are counted (m of 8 rows asked, 0 included), from a bank held
in ``pinned_host`` memory (``put_host_bank``; device memory where the backend has no such kind,
said in the table) into a device pool. Device time (the sum of the GPU events of one profiled
call: the host-to-device row copies) must scale with m, not with the plan's 8 entries: the
table gives each row's device time over its row size's 8 of 8. GB/s is the bytes actually moved
(m rows times the row's bytes; none for the uncounted entries) over the wall time (median of
``--repeats`` calls) or the device time. The counted rows are checked against the bank's and
the other slots against the zeros they started as."""

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
ROWS = ((4, 1), (4, 8), (64, 0), (64, 1), (64, 2), (64, 8))  # (MiB per row, rows asked of 8)
SMOKE_ROWS = ((1 / 16, 0), (1 / 16, 1), (1 / 16, 8))
SLOTS = 8  # pool slots and bank rows
ESTIMATE_S = {"row": 2.5}

_COPY = jax.jit(pc.apply_copy_plan, donate_argnums=0)
_FLOOR = jax.jit(lambda pool, bank, plan: pool, donate_argnums=0)  # a jitted call, no work


def plan(args):
    return [({"mib": mib, "m": m, "label": f"{mib:g} MiB rows, {m} of {SLOTS} asked"},
             ESTIMATE_S["row"])
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
    pool = jax.block_until_ready(_COPY(jnp.zeros((SLOTS, width), jnp.float32), bank, plan))
    got = np.asarray(jax.device_get(pool))  # the first call, on zeros: the untouched slots too
    ok = (all(np.array_equal(got[order[i]], host[order[::-1][i]]) for i in range(m))
          and not got[order[m:]].any())
    pool = jax.block_until_ready(_FLOOR(pool, bank, plan))
    samples, floor = [], []
    for _ in range(max(args.repeats, 3)):  # the copy and the floor take turns
        for step, times in ((_COPY, samples), (_FLOOR, floor)):
            t0 = time.perf_counter()
            pool = jax.block_until_ready(step(pool, bank, plan))
            times.append(time.perf_counter() - t0)
    state = {"pool": pool}
    options = profile_options(args)
    profiled = _COPY if options is None else _COPY.lower(pool, bank, plan).compile(
        compiler_options=options)

    def once():
        state["pool"] = profiled(state["pool"], bank, plan)
        return state["pool"]
    sums, note = device_times([once])
    moved = m * width * 4
    out = {"status": "match" if ok else "MISMATCH", "kind": host_memory_kind() or "device",
           "moved_mib": moved / 2**20, "wall_us": statistics.median(samples) * 1e6,
           "floor_us": statistics.median(floor) * 1e6,
           "wall_gbs": moved / statistics.median(samples) / 1e9 if m else None,
           "device_gbs": moved / (sums[0] * 1e-6) / 1e9 if sums and m else None,
           "device_us": sums[0] if sums else None, "device_note": note}
    if not ok:
        ctx.fail(f"MISMATCH [copy {row['label']}]: a copied pool row differs from its bank row, "
                 "or an uncounted slot was written")
    log(f"copy [{row['label']}]: {cell(out['device_us'], '{:.1f}')} device us, "
        f"{cell(out['wall_gbs'])} GB/s wall, {cell(out['device_gbs'])} GB/s device "
        f"({out['kind']} bank); {out['status']}")
    return out


def markdown(args, done) -> list[str]:
    full = {row["mib"]: r.get("device_us") for row, r in done if row["m"] == SLOTS}
    lines = ["Copy path: `apply_copy_plan` (jitted, pool donated) from a `put_host_bank` bank "
             f"of {SLOTS} rows into a {SLOTS}-slot pool, a plan of {SLOTS} entries of which m "
             "are counted (m of 8 asked). GB/s = the bytes actually moved (m rows of the row "
             "size; the uncounted entries move nothing) / the time (wall: median call; device: "
             "the GPU events of one profiled call); n/a for m = 0, which moves no byte. "
             "vs 8 of 8: the device time over that of the same row size's 8 of 8 (the target: "
             "1 of 8 <= 0.2). wall us: the median call; floor: a donated identity's, so wall "
             "minus floor at 0 of 8 is the price of deciding on the device that nothing moves.",
             "",
             "| row MiB | rows asked (of 8) | bank memory | wall GB/s | device GB/s | device us | "
             "status | MiB moved | vs 8 of 8 | wall us | floor us |",
             "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for row, r in done:
        if "kind" not in r:
            lines.append(f"| {row['mib']:g} | {row['m']} | | | | | {r['status']} | | | | |")
            continue
        base = full.get(row["mib"])
        ratio = (r["device_us"] / base if r.get("device_us") is not None and base else None)
        lines.append(f"| {row['mib']:g} | {row['m']} | {r['kind']} | {cell(r['wall_gbs'])} | "
                     f"{cell(r['device_gbs'])} | {cell(r['device_us'], '{:.1f}')} | "
                     f"{r['status']} | {cell(r.get('moved_mib'), '{:g}')} | "
                     f"{cell(ratio, '{:.3f}')} | {cell(r.get('wall_us'), '{:.1f}')} | "
                     f"{cell(r.get('floor_us'), '{:.1f}')} |")
    return lines
