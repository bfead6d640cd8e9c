"""Prefill double buffers in the reference (docs/semantics.md §5.11).

The plan has the JAX ``PrefillPlan``'s type names and structure: ``gather``
(:class:`PrefillGather`), ``runs`` (:class:`MissRuns`) and ``transfers`` (:class:`HostTransfers`),
fixed-size and -1 padded.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .errors import ERR_CACHE_SIZE, ERR_LAYER, ERR_PREFILL_BUSY, ERR_PREFILL_NOT_BEGUN, int_arg

#: Per-expert row size below which a bank ships its whole layer as one prefill entry.
SMALL_BANK_FEAT_BYTES = 256 * 1024


class PrefillDoesNotFit(ValueError):
    """The pool cannot lend the two prefill buffers their ``2 * E`` slots."""


@dataclass
class PrefillGather:
    """Device-side copies ``slot -> slot`` of the rows already resident above the buffers."""

    dst_slots: np.ndarray  # [E] buffer slot b*E + e of each hit, ascending experts
    src_slots: np.ndarray  # [E] the hit's snapshot slot
    count: int  # hits
    banks: np.ndarray  # [B], -1 padded: banks the gather serves (rows >= 256 KiB)


@dataclass
class MissRuns:
    """The misses as maximal runs of consecutive expert ids."""

    starts: np.ndarray  # [E]
    lens: np.ndarray  # [E]
    count: int


@dataclass
class HostTransfers:
    """The host-transfer entries, grouped by bank in the caller's order."""

    bank: np.ndarray  # [B*E]
    dst_slot: np.ndarray  # [B*E]
    src_row: np.ndarray  # [B*E], layer-local
    rows: np.ndarray  # [B*E]
    whole_layer: np.ndarray  # [B*E] bool
    count: int


@dataclass
class PrefillPlan:
    """What staging one layer into a prefill buffer costs, fixed-size, -1 padded.

    Byte counts come from ``entry_bytes`` (host-side, since they overflow int32 for large banks).
    """

    layer: int
    buffer_id: int
    already_loaded: bool
    gather: PrefillGather
    runs: MissRuns
    transfers: HostTransfers
    error: int = 0

    def entry_bytes(self, bank_feat_bytes) -> list[int]:
        """Bytes of each valid host-transfer entry: ``rows * bank_feat_bytes[bank]``."""
        transfers = self.transfers
        return [
            int(transfers.rows[i]) * int(bank_feat_bytes[int(transfers.bank[i])])
            for i in range(transfers.count)
        ]


class PrefillOps:
    """The prefill operations, mixed into ``ReferenceCache`` over a ``ReferenceState``."""

    def prefill_overlap_fits(self) -> bool:
        """Whether the usable pool can lend the two buffers slots ``[0, 2E)``."""
        return self.capacity >= 2 * self.num_experts and self.cache_size >= 2 * self.num_experts

    def _require_prefill_fits(self):
        # The capacity is a shape in the JAX cache, so this is a trace-time error there; a usable
        # size below 2E is a value (docs/semantics.md §5.15) and handled by each operation.
        if self.capacity < 2 * self.num_experts:
            raise PrefillDoesNotFit(
                f"cache of {self.capacity} slots cannot lend {2 * self.num_experts} "
                f"to the prefill buffers"
            )

    def begin_prefill(self):
        """Open a chunk: both buffers empty and released, and the residency snapshot taken.

        Hits are decided against the snapshot for the whole chunk. The only writer inside a
        chunk (buffer invalidation) only touches slots below ``2E``, which are misses under both
        maps, so gathers and host transfers may run in any order.
        """
        self._require_prefill_fits()
        if not self.prefill_overlap_fits():
            return  # a usable pool below 2E: no chunk opens, as a pool of that size would raise
        self.prefill.layer[:] = -1
        self.prefill.released[:] = True
        self.prefill.open = True
        self.prefill.snapshot = self.residency.slot_for_id.copy()

    def prefetch_prefill_layer(self, layer, bank_feat_bytes) -> PrefillPlan:
        """Stage ``layer`` into buffer ``layer % 2`` and say what moves where."""
        banks = tuple(bank_feat_bytes)
        for feat in banks:
            if isinstance(feat, bool) or not isinstance(feat, numbers.Integral) or feat <= 0:
                raise ValueError(f"bank_feat_bytes must be positive ints, got {bank_feat_bytes!r}")
        self._require_prefill_fits()
        layer = int_arg(layer, "layer")
        E, B = self.num_experts, len(banks)
        buffer_id = layer % 2
        buffer_base = buffer_id * E
        # Small banks are not gathered: their whole-layer entry already covers every row.
        gather_banks = np.full(B, -1, np.int64)
        big = [b for b, feat in enumerate(banks) if feat >= SMALL_BANK_FEAT_BYTES]
        gather_banks[: len(big)] = big

        plan = PrefillPlan(
            layer=layer,
            buffer_id=buffer_id,
            already_loaded=False,
            gather=PrefillGather(
                dst_slots=np.full(E, -1, np.int64),
                src_slots=np.full(E, -1, np.int64),
                count=0,
                banks=gather_banks,
            ),
            runs=MissRuns(starts=np.full(E, -1, np.int64), lens=np.full(E, -1, np.int64), count=0),
            transfers=HostTransfers(
                bank=np.full(B * E, -1, np.int64),
                dst_slot=np.full(B * E, -1, np.int64),
                src_row=np.full(B * E, -1, np.int64),
                rows=np.full(B * E, -1, np.int64),
                whole_layer=np.zeros(B * E, bool),
                count=0,
            ),
        )
        gather, run_parts, transfers = plan.gather, plan.runs, plan.transfers
        # Refusals: every failing check sets its bit (the buffer checks need a valid layer).
        layer_ok = self._layer_ok(layer)
        held = self.prefill.layer[buffer_id] if layer_ok else -1
        if not layer_ok:
            plan.error |= ERR_LAYER
        if not self.prefill.open:
            plan.error |= ERR_PREFILL_NOT_BEGUN
        # Reusing a buffer a running multiply still reads would silently corrupt it: refused.
        if held >= 0 and held != layer and not self.prefill.released[buffer_id]:
            plan.error |= ERR_PREFILL_BUSY
        # The buffers need usable slots [0, 2E); a pool resized below that cannot lend them.
        if self.cache_size < 2 * self.num_experts:
            plan.error |= ERR_CACHE_SIZE
        if plan.error:
            return plan
        # Re-staging what the buffer already holds is a no-op, so a caller can prefetch ahead.
        if held == layer:
            plan.already_loaded = True
            return plan

        # A row is resident only if its snapshot slot is at or above 2E (the buffers own every
        # slot below, and rewrite them every other layer, so "has a slot" is not "is resident")
        # and the live map still has it there: a decode step since begin_prefill may have
        # evicted it, and then the row must come from the host (docs/semantics.md §5.11).
        threshold = 2 * E
        missing = []
        for expert in range(E):
            slot = self.prefill.snapshot[layer, expert]
            if slot >= threshold and self.residency.slot_for_id[layer, expert] == slot:
                k = gather.count
                gather.dst_slots[k] = buffer_base + expert
                gather.src_slots[k] = slot
                gather.count += 1
            else:
                missing.append(expert)
        self.prefill.hit_rows += gather.count
        self.prefill.rows += E

        # Invalidate the buffer: its occupants lose residency (or a decode step would hit on
        # bytes about to be overwritten) and its usage goes to 0 (so the next decode miss takes
        # these free slots first instead of evicting a live resident elsewhere).
        for slot in range(buffer_base, buffer_base + E):
            old = self.residency.id_of_slot[slot]
            if old >= 0:
                self.residency.slot_for_id[old // E, old % E] = -1
            self.residency.id_of_slot[slot] = -1
            self.residency.usage[slot] = 0

        # Misses coalesce into maximal runs of consecutive ids: one entry per run, not per row.
        runs: list[list[int]] = []
        for expert in missing:
            if runs and runs[-1][0] + runs[-1][1] == expert:
                runs[-1][1] += 1
            else:
                runs.append([expert, 1])
        for k, (start, length) in enumerate(runs):
            run_parts.starts[k] = start
            run_parts.lens[k] = length
        run_parts.count = len(runs)

        # Host transfers, banks in the caller's order. A bank under 256 KiB per row ships its
        # whole layer as one entry, even with no misses: it covers the rows the gather skips for
        # small banks, and keeps sub-256 KiB entries out of a batch that would turn synchronous.
        def add_entry(bank, dst_slot, src_row, rows, whole_layer):
            k = transfers.count
            transfers.bank[k] = bank
            transfers.dst_slot[k] = dst_slot
            transfers.src_row[k] = src_row
            transfers.rows[k] = rows
            transfers.whole_layer[k] = whole_layer
            transfers.count += 1

        for bank, feat in enumerate(banks):
            if feat < SMALL_BANK_FEAT_BYTES:
                add_entry(bank, buffer_base, 0, E, True)
            else:
                for start, length in runs:
                    add_entry(bank, buffer_base + start, start, length, False)

        # Nothing staged is registered as resident: the buffer's bytes are volatile.
        self.prefill.layer[buffer_id] = layer
        self.prefill.released[buffer_id] = False
        return plan

    def release_prefill_layer(self, layer):
        """Mark ``layer``'s buffer done; a layer that is not the one staged is ignored."""
        layer = int_arg(layer, "layer")
        if self._layer_ok(layer) and self.prefill.layer[layer % 2] == layer:
            self.prefill.released[layer % 2] = True
