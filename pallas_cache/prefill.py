"""Prefill double buffers: staging layer ``l + 1`` while layer ``l`` computes (docs/semantics.md §5.11).

The two buffers borrow slots ``[0, 2E)`` of the decode pool; the plans are fixed-size and
``-1``-padded, refusals set error bits, and a pool too small to lend the buffers raises
:class:`PrefillDoesNotFit`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_cache import errors, reprs, validate
from pallas_cache.state import CacheState, Residency, check_state
from pallas_cache.hints import IndexLike
from pallas_cache.tree import Record, pytree_dataclass

__all__ = [
    "SMALL_BANK_FEAT_BYTES",
    "HostTransfers",
    "MissRuns",
    "PrefillDoesNotFit",
    "PrefillGather",
    "PrefillPlan",
    "begin_prefill",
    "prefetch_prefill_layer",
    "prefill_overlap_fits",
    "release_prefill_layer",
]

# Per-expert row size below which a bank ships its whole layer as one transfer entry: a batched
# host-to-device copy that mixes sub-256 KiB entries with large ones turns synchronous.
SMALL_BANK_FEAT_BYTES = 256 * 1024


class PrefillDoesNotFit(ValueError):
    """The pool's capacity is below ``2 * E`` slots, so it can never lend the two prefill buffers
    their slots (docs/semantics.md §5.11). Raised at call/trace time: the capacity is static (a
    usable size below ``2E`` within a larger capacity is the value error ``ERR_CACHE_SIZE``)."""

    def __init__(self, cache_size: int, num_experts: int) -> None:
        self.cache_size = cache_size
        self.num_experts = num_experts
        super().__init__(
            f"cache of {cache_size} slots cannot lend {2 * num_experts} slots to the two "
            f"prefill buffers (num_experts={num_experts}); prefill overlap must be off"
        )


@pytree_dataclass
class PrefillGather(Record):
    """The device-side gathers of a prefill plan: rows already resident above the buffers.

    Attributes:
      dst_slots: int32[E]. Buffer slot ``b*E + e`` of each hit, in ascending expert order; -1 past
        ``count``.
      src_slots: int32[E]. The hit's slot in the chunk's snapshot; -1 past ``count``.
      count: int32[]. Number of hits.
      banks: int32[B]. The banks the gathers serve (rows ``>= 256 KiB``), in order, -1 padded.
        Always filled, also on a refusal.
    """

    __repr__ = reprs.plan_repr

    dst_slots: jax.Array
    src_slots: jax.Array
    count: jax.Array
    banks: jax.Array


@pytree_dataclass
class MissRuns(Record):
    """The misses of a prefill plan (ascending ids) as maximal runs of consecutive ids.

    Attributes:
      starts: int32[E]. First expert of each run; -1 past ``count``.
      lens: int32[E]. Length of each run; -1 past ``count``.
      count: int32[]. Number of runs.
    """

    __repr__ = reprs.plan_repr

    starts: jax.Array
    lens: jax.Array
    count: jax.Array


@pytree_dataclass
class HostTransfers(Record):
    """The host-to-device transfer entries of a prefill plan, banks in the caller's order.

    A small bank gives one whole-layer entry ``(bank, b*E, 0, E)``; any other bank one entry per
    miss run ``(bank, b*E + start, start, len)``.

    Attributes:
      bank: int32[B*E]. The bank of each entry; -1 past ``count``.
      dst_slot: int32[B*E]. First destination slot; -1 past ``count``.
      src_row: int32[B*E]. First **layer-local** host row; -1 past ``count``.
      rows: int32[B*E]. Rows moved; -1 past ``count``.
      whole_layer: bool[B*E]. True for a small bank's whole-layer entry (False in padding).
      count: int32[]. Number of entries.
    """

    __repr__ = reprs.plan_repr

    bank: jax.Array
    dst_slot: jax.Array
    src_row: jax.Array
    rows: jax.Array
    whole_layer: jax.Array
    count: jax.Array


@pytree_dataclass
class PrefillPlan(Record):
    """What staging one layer costs (docs/semantics.md §5.11, docs/design.md "Prefill plans").

    Attributes:
      layer: int32[]. The layer asked for.
      buffer_id: int32[]. ``layer % 2``.
      already_loaded: bool[]. The buffer already held this layer: nothing moves.
      gather: the device-side gathers of the hits (:class:`PrefillGather`).
      runs: the misses as runs of consecutive ids (:class:`MissRuns`).
      transfers: the host-transfer entries (:class:`HostTransfers`).
      error: int32[]. 0 or error bits (then gathers, runs and transfers are empty).
    """

    __repr__ = reprs.plan_repr

    layer: jax.Array
    buffer_id: jax.Array
    already_loaded: jax.Array
    gather: PrefillGather
    runs: MissRuns
    transfers: HostTransfers
    error: jax.Array

    def entry_bytes(self, bank_feat_bytes: Sequence[int]) -> np.ndarray:
        """int64[B*E] on the host: ``rows * bank_feat_bytes[bank]`` per transfer entry, -1 in
        padding. Raises ``ValueError`` naming the entry when a product exceeds int64."""
        feat = np.asarray(validate.as_bank_sizes(bank_feat_bytes), np.int64)
        bank = np.asarray(jax.device_get(self.transfers.bank)).astype(np.int64)
        rows = np.asarray(jax.device_get(self.transfers.rows)).astype(np.int64)
        if feat.size == 0:
            return np.full(bank.shape, -1, np.int64)
        # Python ints: a product past int64 is refused, not wrapped (2**62 bytes x 4 rows is 0).
        exact = np.where(bank >= 0, rows.astype(object) * feat[np.clip(bank, 0, feat.size - 1)]
                         .astype(object), -1)
        too_big = np.flatnonzero(exact > np.iinfo(np.int64).max)
        if too_big.size:
            i = int(too_big[0])
            raise ValueError(f"entry {i}: {int(rows[i])} rows x {int(feat[bank[i]])} bytes = "
                             f"{exact[i]} bytes, above int64's {np.iinfo(np.int64).max}")
        return exact.astype(np.int64)


def prefill_overlap_fits(state: CacheState) -> jax.Array:
    """Whether the usable pool can lend the two buffers their ``2E`` slots (``S >= 2E``), as a
    bool[] (traced under ``jit``: the usable size is data). Always False when the capacity is
    below ``2E``."""
    check_state(state)
    fits = state.capacity >= 2 * state.num_experts
    return jnp.asarray(fits) & (state.cache_size >= 2 * state.num_experts)


def _require_fit(state: CacheState):
    check_state(state)
    if state.capacity < 2 * state.num_experts:
        raise PrefillDoesNotFit(state.capacity, state.num_experts)


def begin_prefill(state: CacheState) -> CacheState:
    """Open a prefill chunk: both buffers empty and released, ``slot_for_id`` snapshotted.

    Writes ``prefill``.

    The chunk classifies every row against this snapshot, so the classification is stable for
    the whole chunk. Raises :class:`PrefillDoesNotFit` when the capacity is below ``2E``; when
    only the usable size is (a traced value), the state comes back unchanged and no chunk is
    opened (docs/semantics.md §5.15), as a pool of that size would have raised. Jittable.
    """
    _require_fit(state)
    fits = state.cache_size >= 2 * state.num_experts
    return state.replace(prefill=state.prefill.replace(
        layer=jnp.where(fits, -1, state.prefill.layer),
        released=state.prefill.released | fits,
        open=state.prefill.open | fits,
        snapshot=jnp.where(fits, state.residency.slot_for_id, state.prefill.snapshot),
    ))


def _compact(mask, values, size):
    """``values[mask]`` packed to the front of an int32[size] array, -1 after."""
    position = jnp.cumsum(mask, dtype=jnp.int32) - 1
    return jnp.full((size,), -1, jnp.int32).at[jnp.where(mask, position, size)].set(
        values, mode="drop")


def prefetch_prefill_layer(state: CacheState, layer: IndexLike, bank_feat_bytes: Sequence[int]
                           ) -> tuple[CacheState, PrefillPlan]:
    """Stage ``layer`` into buffer ``layer % 2`` and say what that costs (docs/semantics.md §5.11).

    Writes ``residency`` and ``prefill``.

    Args:
      state: the cache, with a chunk opened by :func:`begin_prefill`.
      layer: int, possibly traced.
      bank_feat_bytes: static tuple of positive ints, each weight bank's per-expert row size in
        bytes; ``transfers.bank`` and ``gather.banks`` index it.

    Returns:
      ``(state, PrefillPlan)``. If the buffer already holds ``layer``, ``already_loaded`` and
      nothing else changes. Otherwise: ``prefill_hit_rows += hits``, ``prefill_rows += E``, the
      buffer's slots are invalidated, and the buffer now holds ``layer``, not released.

      A usable size below ``2E`` (within a capacity of at least ``2E``) sets ERR_CACHE_SIZE.

    Raises:
      PrefillDoesNotFit: capacity ``< 2E``. TypeError/ValueError: bad ``bank_feat_bytes`` or
      layer type.
    """
    _require_fit(state)
    return _prefetch_prefill_layer(state, validate.as_index("layer", layer),
                                   banks=validate.as_bank_sizes(bank_feat_bytes))


@functools.partial(jax.jit, static_argnames=("banks",))
def _prefetch_prefill_layer(state: CacheState, layer, banks: tuple):
    L, E = state.num_layers, state.num_experts
    buffer_id = jnp.remainder(layer, 2)
    held = state.prefill.layer[buffer_id]
    error = _prefetch_errors(state, layer, buffer_id, held)
    accepted = error == 0
    already_loaded = accepted & (held == layer)
    stage = accepted & ~already_loaded

    layer_c = jnp.clip(layer, 0, L - 1)
    buffer_base = buffer_id * E
    experts = lax.iota(jnp.int32, E)
    snapshot_row = state.prefill.snapshot[layer_c]
    # Below 2E is the buffers' own range: a miss. A snapshot hit that a decode step evicted (or
    # moved) since begin_prefill is a miss too: its slot no longer holds the expert's rows.
    still_there = state.residency.slot_for_id[layer_c] == snapshot_row
    hit = stage & (snapshot_row >= 2 * E) & still_there
    runs = _miss_runs(stage & ~hit)
    gather_banks = [bank for bank, feat in enumerate(banks) if feat >= SMALL_BANK_FEAT_BYTES]
    gather_banks = jnp.asarray(gather_banks + [-1] * (len(banks) - len(gather_banks)), jnp.int32)
    staged = _stage_buffer(state, layer, buffer_id, stage)
    new_state = staged.replace(prefill=staged.prefill.replace(
        hit_rows=state.prefill.hit_rows + jnp.sum(hit, dtype=jnp.int32),
        rows=state.prefill.rows + jnp.where(stage, E, 0),
    ))
    plan = PrefillPlan(
        layer=layer,
        buffer_id=buffer_id,
        already_loaded=already_loaded,
        gather=PrefillGather(
            dst_slots=_compact(hit, buffer_base + experts, E),
            src_slots=_compact(hit, snapshot_row, E),
            count=jnp.sum(hit, dtype=jnp.int32),
            banks=gather_banks,
        ),
        runs=runs,
        transfers=_host_transfers(banks, stage, buffer_base, runs, E),
        error=error,
    )
    return new_state, plan


def _prefetch_errors(state: CacheState, layer, buffer_id, held):
    """The error bits of a prefetch: all failing checks set their bits (docs/design.md). "Busy"
    asks about the layer's buffer, which only an in-range layer has; "not begun" does not
    depend on the layer."""
    layer_error = errors.layer_bits(layer, state.num_layers)
    busy = (layer_error == 0) & (held >= 0) & (held != layer) & ~state.prefill.released[buffer_id]
    return (
        layer_error
        | jnp.where(state.prefill.open, 0, errors.ERR_PREFILL_NOT_BEGUN)
        | jnp.where(busy, errors.ERR_PREFILL_BUSY, 0)
        | jnp.where(state.cache_size < 2 * state.num_experts, errors.ERR_CACHE_SIZE, 0)
    ).astype(jnp.int32)


def _miss_runs(miss) -> MissRuns:
    """Runs of consecutive missing ids: a run starts at a miss whose predecessor is not a miss."""
    E = miss.shape[0]
    previous_miss = jnp.concatenate([jnp.zeros((1,), jnp.bool_), miss[:-1]])
    starts = miss & ~previous_miss
    run_index = jnp.cumsum(starts, dtype=jnp.int32) - 1
    run_count = jnp.sum(starts, dtype=jnp.int32)
    run_starts = _compact(starts, lax.iota(jnp.int32, E), E)
    run_lens = jnp.zeros((E,), jnp.int32).at[jnp.where(miss, run_index, E)].add(1, mode="drop")
    run_lens = jnp.where(lax.iota(jnp.int32, E) < run_count, run_lens, -1)
    return MissRuns(starts=run_starts, lens=run_lens, count=run_count)


def _host_transfers(banks: tuple, stage, buffer_base, runs: MissRuns, E: int) -> HostTransfers:
    """Host-transfer entries, bank by bank in the caller's order (the bank loop is static): a
    small bank's whole layer as one entry (even with no misses), else one entry per miss run."""
    num_entries = len(banks) * E
    entry_bank = jnp.full((num_entries,), -1, jnp.int32)
    entry_dst = entry_src = entry_rows = entry_bank
    entry_whole = jnp.zeros((num_entries,), jnp.bool_)
    entry_count = jnp.int32(0)
    for bank, feat in enumerate(banks):
        if feat < SMALL_BANK_FEAT_BYTES:  # the whole layer as one entry, even with no misses
            count = stage.astype(jnp.int32)
            index = jnp.where(stage, entry_count, num_entries)[None]
            entry_bank = entry_bank.at[index].set(bank, mode="drop")
            entry_dst = entry_dst.at[index].set(buffer_base, mode="drop")
            entry_src = entry_src.at[index].set(0, mode="drop")
            entry_rows = entry_rows.at[index].set(E, mode="drop")
            entry_whole = entry_whole.at[index].set(True, mode="drop")
        else:  # one entry per miss run
            count = runs.count
            run = lax.iota(jnp.int32, E)
            index = jnp.where(run < runs.count, entry_count + run, num_entries)
            entry_bank = entry_bank.at[index].set(bank, mode="drop")
            entry_dst = entry_dst.at[index].set(buffer_base + runs.starts, mode="drop")
            entry_src = entry_src.at[index].set(runs.starts, mode="drop")
            entry_rows = entry_rows.at[index].set(runs.lens, mode="drop")
        entry_count = entry_count + count
    return HostTransfers(bank=entry_bank, dst_slot=entry_dst, src_row=entry_src,
                         rows=entry_rows, whole_layer=entry_whole,
                         count=entry_count.astype(jnp.int32))


def _stage_buffer(state: CacheState, layer, buffer_id, stage) -> CacheState:
    """Invalidate the buffer's slots for a staged layer: occupants lose residency, slots empty
    with usage 0; the buffer records the layer, not yet released."""
    L, E, S = state.num_layers, state.num_experts, state.capacity
    buffer_base = buffer_id * E
    slots = lax.iota(jnp.int32, S)
    in_buffer = stage & (slots >= buffer_base) & (slots < buffer_base + E)
    occupant = state.residency.id_of_slot
    slot_for_id = state.residency.slot_for_id.reshape(-1).at[
        jnp.where(in_buffer & (occupant >= 0), occupant, L * E)].set(-1, mode="drop").reshape(L, E)
    this_buffer = stage & (jnp.arange(2) == buffer_id)
    return state.replace(
        residency=Residency(slot_for_id=slot_for_id, id_of_slot=jnp.where(in_buffer, -1, occupant),
                            usage=jnp.where(in_buffer, 0, state.residency.usage)),
        prefill=state.prefill.replace(layer=jnp.where(this_buffer, layer, state.prefill.layer),
                                      released=state.prefill.released & ~this_buffer),
    )


def release_prefill_layer(state: CacheState, layer: IndexLike) -> CacheState:
    """Mark ``layer``'s buffer released, so the next layer of its parity may reuse it.

    Writes ``prefill.released``.

    A layer that is not the one its buffer holds (out of range included) is ignored. Returns the
    state only (docs/design.md).
    """
    check_state(state)
    layer = validate.as_index("layer", layer)
    buffer_id = jnp.remainder(layer, 2)
    holds = (layer >= 0) & (layer < state.num_layers) & (state.prefill.layer[buffer_id] == layer)
    return state.replace(prefill=state.prefill.replace(
        released=state.prefill.released | (holds & (jnp.arange(2) == buffer_id))))
