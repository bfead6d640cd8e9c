"""Readable host-side views of a cache state (:func:`describe`, one row per slot) and of what a
step changed (:func:`diff`), as Python objects that print as text and render as HTML in Jupyter.
Not jittable: call them on the states a loop returns."""

from __future__ import annotations

import dataclasses
import html
import operator
from typing import Any, NamedTuple

import jax
import numpy as np

from pallas_cache import evictions
from pallas_cache.state import CacheState, check_state
from pallas_cache.validate import INT32_MIN

__all__ = ["CacheDiff", "CacheView", "SlotEntry", "SlotRow", "describe", "diff"]

# Slot status values of SlotRow.status.
RESIDENT, EMPTY, FORGOTTEN = "resident", "empty", "forgotten"


class SlotRow(NamedTuple):
    """One slot of a described state.

    Attributes:
      slot: the slot index.
      layer, expert: the occupant, or None for an empty slot.
      usage: the raw ``usage`` value (0 empty, the smallest int32 after ``forget_slot``).
      age: ``step - usage`` (steps since last touched) for an occupied slot, else None.
      status: ``"resident"``, ``"empty"``, or ``"forgotten"`` (emptied by ``forget_slot``: the
        very first victim).
      prot, freq: under ``Eviction.PAIR_LFU``, the occupant's protection bit and Q16 frequency
        (its victim key is ``(prot, freq, usage, slot)``, docs/semantics.md §5.16); else None.
        (An eviction's record names the per-expert fields its rows show: ``view_columns``.)
    """

    slot: int
    layer: int | None
    expert: int | None
    usage: int
    age: int | None
    status: str
    prot: bool | None = None
    freq: int | None = None


class SlotEntry(NamedTuple):
    """A slot and the expert a change concerns (compares equal to a plain ``(slot, layer,
    expert)`` tuple)."""

    slot: int
    layer: int
    expert: int


def _host_fields(state, paths):
    """The leaves at ``paths`` (``"residency.usage"``, ``"step"``) of one (unbatched) state as
    NumPy arrays, keyed by their last name, plus the eviction's name under ``"eviction"``, its
    ``view_columns`` under ``"columns"`` and those per-expert fields of its bookkeeping (``prot``,
    ``freq`` for PAIR_LFU)."""
    values = jax.device_get({path.rsplit(".", 1)[-1]: operator.attrgetter(path)(state)
                             for path in paths})
    eviction = state.eviction
    bookkeeping = jax.device_get(state.eviction_state)
    for name in eviction.view_columns:
        values[name] = getattr(bookkeeping, name)
    id_of_slot = np.asarray(values["id_of_slot"])
    if id_of_slot.ndim != 1:
        raise ValueError(
            f"diff takes one cache, got a batch of shape {id_of_slot.shape[:-1]}; "
            f"pick one with pc.take_state(batch, i)")
    fields = {name: np.asarray(value) for name, value in values.items()}
    fields["eviction"] = eviction.name
    fields["columns"] = eviction.view_columns
    return fields


def _usage_text(usage: int) -> str:
    return "INT32_MIN" if usage == INT32_MIN else str(usage)


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns, one space-padded line per row."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths))
             for line in [header, *rows]]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclasses.dataclass(frozen=True)
class CacheView:
    """A host-side snapshot of one cache, one row per slot. Build it with :func:`describe`.

    Attributes:
      num_layers, num_experts, cache_size: the geometry ``L, E, S`` (``S`` the usable size).
      step: the clock.
      rows: one :class:`SlotRow` per usable slot, in slot order (slots at or past ``S`` are
        neither empty nor occupied, docs/semantics.md §5.15, and have no row).
      capacity: the allocated slots ``C >= S`` (``None``: the same as ``S``).
      eviction: the state's eviction (``"lru"``, ``"pair_lfu"``, ...).
      columns: the per-slot bookkeeping fields the rows carry (the eviction's ``view_columns``).
    """

    num_layers: int
    num_experts: int
    cache_size: int
    step: int
    rows: list[SlotRow]
    capacity: int | None = None
    eviction: str = "lru"
    columns: tuple[str, ...] = ()

    @property
    def residents(self) -> list[SlotEntry]:
        """Every occupied slot as ``(slot, layer, expert)``, in slot order."""
        return [SlotEntry(r.slot, r.layer, r.expert) for r in self.rows if r.status == RESIDENT]

    @property
    def resident_count(self) -> int:
        return len(self.residents)

    def resident_per_layer(self) -> list[int]:
        """How many slots each layer holds (index = layer)."""
        counts = [0] * self.num_layers
        for entry in self.residents:
            counts[entry.layer] += 1
        return counts

    def header(self) -> str:
        per_layer = ", ".join(str(c) for c in self.resident_per_layer())
        capacity = ("" if self.capacity in (None, self.cache_size)
                    else f" (capacity {self.capacity})")
        default = self.eviction == evictions.Eviction.LRU.value  # init's default is not shown
        eviction = "" if default else f" eviction={self.eviction}"
        return (f"CacheState L={self.num_layers} E={self.num_experts} S={self.cache_size}"
                f"{capacity} step={self.step}{eviction} "
                f"resident={self.resident_count}/{self.cache_size} "
                f"(per layer: {per_layer})")

    def _table(self) -> tuple[list[str], list[list[str]]]:
        header = ["slot", "layer", "expert", "usage", "age", *self.columns]
        rows = []
        for r in self.rows:
            occupied = r.status == RESIDENT
            rows.append([
                str(r.slot),
                str(r.layer) if occupied else "-",
                str(r.expert) if occupied else "-",
                _usage_text(r.usage),
                str(r.age) if occupied else r.status,
            ] + [str(int(getattr(r, name))) if occupied else "-" for name in self.columns])
        return header, rows

    def __str__(self) -> str:
        return self.header() + "\n" + _text_table(*self._table())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<div><p>{html.escape(self.header())}</p>{_html_table(*self._table())}</div>"


def describe(state: CacheState) -> CacheView | list[Any]:
    """One row per slot: who lives there, when it was last touched, how stale it is.

    Args:
      state: a ``CacheState``: one cache, or a batch (stacked or vmapped) of them.

    Returns:
      A :class:`CacheView` with one row per usable slot. ``print`` it for a text table, display
      it in a notebook for an HTML table, or read ``view.rows`` / ``view.residents``. For a
      batch, a list with one per cache (nested, one level per batch axis).
    """
    check_state(state, batched=True)
    if isinstance(state.residency.id_of_slot, jax.core.Tracer):
        raise TypeError("describe reads the state on the host and cannot run under jit/vmap; "
                        "call it on the state the compiled function returns")
    if np.ndim(state.residency.id_of_slot) > 1:
        return [describe(jax.tree.map(lambda leaf: leaf[i], state))
                for i in range(np.shape(state.residency.id_of_slot)[0])]
    fields = _host_fields(state, ["residency.id_of_slot", "residency.usage", "step",
                                  "residency.slot_for_id", "cache_size"])
    num_layers, num_experts = fields["slot_for_id"].shape
    step = int(fields["step"])
    usable = int(fields["cache_size"])
    rows = []
    for slot, (flat_id, usage) in enumerate(zip(fields["id_of_slot"][:usable].tolist(),
                                               fields["usage"][:usable].tolist())):
        if flat_id >= 0:
            layer, expert = divmod(flat_id, num_experts)
            key = {name: fields[name][layer, expert].item() for name in fields["columns"]}
            rows.append(SlotRow(slot, layer, expert, usage, step - usage, RESIDENT, **key))
        else:
            status = FORGOTTEN if usage == INT32_MIN else EMPTY
            rows.append(SlotRow(slot, None, None, usage, None, status))
    return CacheView(num_layers=num_layers, num_experts=num_experts, cache_size=usable, step=step,
                     rows=rows, capacity=int(fields["id_of_slot"].shape[0]),
                     eviction=fields["eviction"], columns=fields["columns"])


@dataclasses.dataclass(frozen=True)
class CacheDiff:
    """What changed between two states of one cache. Build it with :func:`diff`.

    It compares two snapshots, not the events between them: over several steps, an expert that
    was evicted and later re-installed into the same slot shows as refreshed, and across a clock
    rebase (docs/semantics.md §5.12, which renumbers every usage) every occupied slot shows as refreshed.

    Attributes:
      step_before, step_after: the two clocks.
      installed: slots whose occupant changed to a (new) expert: ``(slot, layer, expert)`` of the
        newcomer, in slot order.
      evicted: slots whose previous occupant left (evicted by a fetch, emptied by
        ``materialize_layer``, a prefill or ``forget_slot``): ``(slot, layer, expert)`` of the
        occupant that left. A slot that changed hands appears in both lists.
      refreshed: slots with the same occupant whose usage changed (a hit): ``(slot, layer,
        expert)``.
      usage_before, usage_after: ``{slot: usage}`` for every slot in the three lists.
    """

    step_before: int
    step_after: int
    installed: list[SlotEntry]
    evicted: list[SlotEntry]
    refreshed: list[SlotEntry]
    usage_before: dict[int, int]
    usage_after: dict[int, int]

    @property
    def unchanged(self) -> bool:
        """True when no slot was installed, evicted or refreshed."""
        return not (self.installed or self.evicted or self.refreshed)

    def header(self) -> str:
        return (f"step {self.step_before} -> {self.step_after}: {len(self.installed)} installed, "
                f"{len(self.evicted)} evicted, {len(self.refreshed)} refreshed")

    def _table(self) -> tuple[list[str], list[list[str]]]:
        header = ["change", "slot", "layer", "expert", "usage before", "usage after"]
        rows = []
        for change, entries in (("installed", self.installed), ("evicted", self.evicted),
                                ("refreshed", self.refreshed)):
            for e in entries:
                rows.append([change, str(e.slot), str(e.layer), str(e.expert),
                             _usage_text(self.usage_before[e.slot]),
                             _usage_text(self.usage_after[e.slot])])
        return header, rows

    def __str__(self) -> str:
        if self.unchanged:
            return self.header()
        return self.header() + "\n" + _text_table(*self._table())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<div><p>{html.escape(self.header())}</p>{_html_table(*self._table())}</div>"


def diff(before: CacheState, after: CacheState) -> CacheDiff:
    """The installs, evictions and refreshes that turned ``before`` into ``after``.

    Args:
      before, after: two ``CacheState`` of the same geometry (one cache each), typically the
        input and output of one ``ensure``/``ensure_hybrid`` call.

    Returns:
      A :class:`CacheDiff` with ``installed``, ``evicted`` and ``refreshed`` lists of
      ``(slot, layer, expert)``.

    Slots outside the usable pool hold nothing (docs/semantics.md §5.15), so a
    :func:`~pallas_cache.resize` between the two states shows the experts a shrink freed as
    evicted, and the slots themselves in neither list.

    Raises:
      ValueError: the two states have different geometries or evictions (compare states
        of one pool only).
    """
    check_state(before)
    check_state(after)
    names = ["residency.id_of_slot", "residency.usage", "step", "residency.slot_for_id"]
    old, new = _host_fields(before, names), _host_fields(after, names)
    if old["eviction"] != new["eviction"]:
        raise ValueError(f"cannot diff caches of different evictions: "
                         f"{old['eviction']} vs {new['eviction']}")
    if old["slot_for_id"].shape != new["slot_for_id"].shape or \
            old["id_of_slot"].shape != new["id_of_slot"].shape:
        raise ValueError(
            f"cannot diff caches of different geometry: L,E={old['slot_for_id'].shape} "
            f"S={old['id_of_slot'].shape[0]} vs L,E={new['slot_for_id'].shape} "
            f"S={new['id_of_slot'].shape[0]}")
    num_experts = old["slot_for_id"].shape[1]

    def entry(slot, flat_id):
        layer, expert = divmod(int(flat_id), num_experts)
        return SlotEntry(int(slot), layer, expert)

    installed, evicted, refreshed = [], [], []
    for slot, (old_id, new_id, old_usage, new_usage) in enumerate(zip(
            old["id_of_slot"].tolist(), new["id_of_slot"].tolist(),
            old["usage"].tolist(), new["usage"].tolist())):
        if old_id != new_id:
            if old_id >= 0:
                evicted.append(entry(slot, old_id))
            if new_id >= 0:
                installed.append(entry(slot, new_id))
        elif new_id >= 0 and old_usage != new_usage:
            refreshed.append(entry(slot, new_id))
    touched = {e.slot for e in installed + evicted + refreshed}
    return CacheDiff(
        step_before=int(old["step"]),
        step_after=int(new["step"]),
        installed=installed,
        evicted=evicted,
        refreshed=refreshed,
        usage_before={s: int(old["usage"][s]) for s in sorted(touched)},
        usage_after={s: int(new["usage"][s]) for s in sorted(touched)},
    )
