"""The invariants every ``ensure`` / ``ensure_hybrid`` plan holds, checked on the host without
the reference (docs/semantics.md §3, §4, §5.2, §5.4): :func:`check_plan` for a user's own loop."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pallas_cache import errors, validate
from pallas_cache.plans import EnsurePlan
from pallas_cache.state import CacheState
from pallas_cache.testing.assertions import first_difference

__all__ = ["check_plan", "check_state"]


class _Host:
    """One unbatched state's fields as NumPy arrays."""

    def __init__(self, state: CacheState, what: str):
        if not isinstance(state, CacheState):
            raise TypeError(f"{what} must be a CacheState (from pc.init), got "
                            f"{type(state).__name__}")
        if np.ndim(state.residency.id_of_slot) != 1:
            raise ValueError(f"check_plan takes one cache; {what} is a batch of shape "
                             f"{np.shape(state.residency.id_of_slot)[:-1]} (take one with "
                             f"pc.take_state)")
        residency = state.residency
        fields = jax.device_get({
            "slot_for_id": residency.slot_for_id, "id_of_slot": residency.id_of_slot,
            "usage": residency.usage, "cache_size": state.cache_size, "step": state.step,
            "stats": state.stats, "rebase_threshold": state.settings.rebase_threshold})
        self.slot_for_id = np.asarray(fields["slot_for_id"], np.int64)
        self.id_of_slot = np.asarray(fields["id_of_slot"], np.int64)
        self.usage = np.asarray(fields["usage"], np.int64)
        self.cache_size = int(fields["cache_size"])
        self.step = int(fields["step"])
        self.stats = np.asarray(fields["stats"], np.int64)
        self.rebase_threshold = int(fields["rebase_threshold"])
        self.num_layers, self.num_experts = self.slot_for_id.shape


def _fail(message: str) -> None:
    raise AssertionError(f"check_plan: {message}")


def _check_maps(s: _Host, what: str) -> None:
    """docs/semantics.md §3's invariants: mutually inverse maps, nothing past the usable size."""
    E, C, S = s.num_experts, s.id_of_slot.shape[0], s.cache_size
    if not s.num_experts <= S <= C:
        _fail(f"{what}: cache_size {S} outside [E={E}, C={C}]")
    for slot in np.flatnonzero(s.id_of_slot >= 0):
        flat = int(s.id_of_slot[slot])
        if flat >= s.num_layers * E:
            _fail(f"{what}: id_of_slot[{slot}] = {flat} is not a flat id (< L*E = "
                  f"{s.num_layers * E})")
        if s.slot_for_id.reshape(-1)[flat] != slot:
            _fail(f"{what}: id_of_slot[{slot}] = {flat} but slot_for_id of that id is "
                  f"{int(s.slot_for_id.reshape(-1)[flat])}")
    for flat in np.flatnonzero(s.slot_for_id.reshape(-1) >= 0):
        slot = int(s.slot_for_id.reshape(-1)[flat])
        if slot >= S or s.id_of_slot[slot] != flat:
            layer, expert = divmod(int(flat), E)
            _fail(f"{what}: slot_for_id[{layer}, {expert}] = {slot}, which does not hold it")
    unusable = np.arange(C) >= S
    if np.any(unusable & ((s.id_of_slot != -1) | (s.usage != 0))):
        slot = int(np.flatnonzero(unusable & ((s.id_of_slot != -1) | (s.usage != 0)))[0])
        _fail(f"{what}: unusable slot {slot} (>= cache_size {S}) is not empty with usage 0")
    if np.any(s.usage > s.step):
        slot = int(np.flatnonzero(s.usage > s.step)[0])
        _fail(f"{what}: usage[{slot}] = {int(s.usage[slot])} is above the step {s.step}")


def check_state(state: CacheState) -> None:
    """Raise ``AssertionError`` if one state breaks docs/semantics.md §3's invariants: the two
    maps mutually inverse, every resident in a usable slot, unusable slots empty with usage 0,
    no usage above the clock."""
    _check_maps(_Host(state, "state"), "the state")


def _as_int(name: str, value: Any) -> int:
    if validate.is_int(value):  # a Python int of any size, as the library's as_index takes it
        return int(value)
    array = np.asarray(jax.device_get(value))
    if array.shape != () or array.dtype.kind not in "iu":
        raise TypeError(f"check_plan: {name} must be an integer scalar, got {value!r}")
    return int(array)


def check_plan(state_before: CacheState, layer: Any, routes: Any, plan: EnsurePlan,
               state_after: CacheState) -> None:
    """Check one ``ensure`` / ``ensure_hybrid`` call against the rules every plan obeys.

    Raises ``AssertionError`` naming the broken invariant and the route, slot or entry:

    - a refused call (``plan.error != 0``) is refused exactly when the layer or an id is out of
      range, with those bits, and changed nothing (empty plan, same state);
    - every non-padding route is assigned exactly once, to a slot (``slots >= 0``) or to the
      CPU (``cpu``); padding (``-1``) to neither; duplicates of an expert share the answer;
    - a route's slot is usable and holds its expert after the call; a hit keeps its slot; a
      device route of a missed expert is one of the copies; CPU routes are misses;
    - copies: ``count`` entries in range (slots in ``[0, cache_size)``, rows in ``[0, E)``),
      distinct, each a routed expert that was not resident, -1 past ``count``; no copy
      overwrites a slot this call touched (a hit); every other slot keeps its occupant;
    - counts add up: ``active`` distinct routed experts, ``missing`` of them not resident,
      ``fetched == copy.count <= missing``, and the layer's ``stats`` row grew by exactly
      ``(1, active, missing, fetched)``; the clock advanced by one (or was rebased);
    - both states keep docs/semantics.md §3's invariants (:func:`check_state`).

    Host-side (call it outside ``jit`` on concrete values), one cache at a time; it needs no
    reference, only the states around the call.
    """
    before, after = _Host(state_before, "state_before"), _Host(state_after, "state_after")
    if not isinstance(plan, EnsurePlan):
        raise TypeError(f"plan must be the EnsurePlan of the call (pc.ensure(...)[1]), got "
                        f"{type(plan).__name__}")
    L, E = before.num_layers, before.num_experts
    layer = _as_int("layer", layer)
    try:  # read as the library reads them: an id outside int32 is refused, never wrapped
        ids = np.asarray(validate.as_routes(routes), np.int64)
    except TypeError as error:
        raise TypeError(f"check_plan: routes: {error}") from None
    flat = ids.reshape(-1)
    slots = np.asarray(jax.device_get(plan.slots), np.int64)
    cpu = np.asarray(jax.device_get(plan.cpu), bool)
    if slots.shape != ids.shape or cpu.shape != ids.shape:
        _fail(f"plan.slots {slots.shape} / plan.cpu {cpu.shape} differ from routes {ids.shape}")
    slots, cpu = slots.reshape(-1), cpu.reshape(-1)
    copy = plan.copy
    dst = np.asarray(jax.device_get(copy.dst_slots), np.int64)
    src = np.asarray(jax.device_get(copy.src_rows), np.int64)
    count = _as_int("plan.copy.count", copy.count)
    counters = {name: _as_int(f"plan.{name}", getattr(plan, name))
                for name in ("active", "missing", "fetched", "error")}
    _check_maps(before, "state_before")
    _check_maps(after, "state_after")

    expected_error = 0
    if not 0 <= layer < L:
        expected_error |= errors.ERR_LAYER
    if np.any((flat < -1) | (flat >= E)):
        expected_error |= errors.ERR_EXPERT_ID
    if counters["error"] != expected_error:
        _fail(f"error bits {counters['error']} ({errors.describe_bits(counters['error'])}), "
              f"expected {expected_error} for layer {layer} of L={L} and routes in [-1, {E})")
    if expected_error:
        if np.any(slots != -1) or np.any(cpu) or count != 0 or np.any(dst != -1) or np.any(
                src != -1) or any(counters[k] for k in ("active", "missing", "fetched")):
            _fail("a refused call's plan is not the empty plan (slots -1, no cpu, no copies, "
                  "zero counts)")
        difference = first_difference(state_before, state_after)
        if difference is not None:
            _fail(f"a refused call changed the state at {difference}")
        return

    padding = flat == -1
    routed = np.unique(flat[~padding])
    resident_before = before.slot_for_id[layer]
    misses = routed[resident_before[routed] < 0]
    hits = routed[resident_before[routed] >= 0]
    hit_slots = resident_before[hits]

    # Every route once; padding to neither; duplicates share.
    for i in np.flatnonzero(padding):
        if slots[i] != -1 or cpu[i]:
            _fail(f"padding route {i} has slot {slots[i]} / cpu {cpu[i]}; expected -1 / False")
    for i in np.flatnonzero(~padding):
        if (slots[i] >= 0) == bool(cpu[i]):
            _fail(f"route {i} (expert {flat[i]}) has slot {slots[i]} and cpu {bool(cpu[i])}: "
                  f"a route goes to exactly one of a slot and the CPU")
    for expert in routed:
        at = np.flatnonzero(flat == expert)
        if np.any(slots[at] != slots[at[0]]) or np.any(cpu[at] != cpu[at[0]]):
            _fail(f"duplicate routes {at.tolist()} of expert {expert} got different answers: "
                  f"slots {slots[at].tolist()}, cpu {cpu[at].tolist()}")

    # Copies.
    if not 0 <= count <= dst.shape[0] or dst.shape != src.shape:
        _fail(f"copy.count {count} outside [0, {dst.shape[0]}] (or dst {dst.shape} != src "
              f"{src.shape})")
    if np.any(dst[count:] != -1) or np.any(src[count:] != -1):
        _fail(f"copy entries at or past count {count} are not -1")
    dst, src = dst[:count], src[:count]
    for k in range(count):
        if not 0 <= dst[k] < after.cache_size:
            _fail(f"copy {k}: slot {dst[k]} outside the usable [0, {after.cache_size})")
        if not 0 <= src[k] < E:
            _fail(f"copy {k}: row {src[k]} outside [0, E={E})")
        if src[k] not in misses:
            _fail(f"copy {k}: row {src[k]} is not a routed expert that missed")
        if dst[k] in hit_slots:
            _fail(f"copy {k}: slot {dst[k]} holds a hit of this call, which may not be evicted")
        if after.id_of_slot[dst[k]] != layer * E + src[k]:
            _fail(f"copy {k}: slot {dst[k]} holds {after.id_of_slot[dst[k]]} after the call, "
                  f"not the copied flat id {layer * E + src[k]}")
    if len(set(dst.tolist())) != count or len(set(src.tolist())) != count:
        _fail(f"copy slots {dst.tolist()} or rows {src.tolist()} repeat")
    untouched = np.ones(after.id_of_slot.shape[0], bool)
    untouched[dst] = False
    changed = untouched & (after.id_of_slot != before.id_of_slot)
    if after.cache_size != before.cache_size:
        _fail(f"cache_size changed from {before.cache_size} to {after.cache_size}")
    if np.any(changed):
        slot = int(np.flatnonzero(changed)[0])
        _fail(f"slot {slot} changed occupant ({before.id_of_slot[slot]} -> "
              f"{after.id_of_slot[slot]}) without a copy")

    # Each route's slot holds its expert; hits keep theirs; device misses are copies.
    fetched_experts = set(src.tolist())
    for i in np.flatnonzero(~padding):
        expert, slot = int(flat[i]), int(slots[i])
        if slot >= 0:
            if slot >= after.cache_size or after.id_of_slot[slot] != layer * E + expert:
                _fail(f"route {i} (expert {expert}) reads slot {slot}, which does not hold it "
                      f"after the call")
            if resident_before[expert] >= 0 and slot != resident_before[expert]:
                _fail(f"route {i}: hit expert {expert} moved from slot "
                      f"{resident_before[expert]} to {slot}")
            if resident_before[expert] < 0 and expert not in fetched_experts:
                _fail(f"route {i}: missed expert {expert} got slot {slot} without a copy")
        elif resident_before[expert] >= 0:
            _fail(f"route {i}: expert {expert} was resident (slot {resident_before[expert]}) "
                  f"but went to the CPU")
        elif expert in fetched_experts:
            _fail(f"route {i}: expert {expert} was copied in but its route went to the CPU")

    # Counts.
    expected = {"active": routed.size, "missing": misses.size, "fetched": count}
    for name, value in expected.items():
        if counters[name] != value:
            _fail(f"plan.{name} = {counters[name]}, expected {value}")
    grown = after.stats - before.stats
    row = np.array([1, routed.size, misses.size, count])
    if np.any(grown[layer] != row):
        _fail(f"stats row {layer} grew by {grown[layer].tolist()}, expected {row.tolist()} "
              f"(calls, active, missing, fetched)")
    others = np.arange(L) != layer
    if np.any(grown[others] != 0):
        _fail(f"stats of layer {int(np.flatnonzero(np.any(grown != 0, axis=1) & others)[0])} "
              f"changed on a call to layer {layer}")
    rebased = before.step >= before.rebase_threshold
    if not rebased and after.step != before.step + 1:
        _fail(f"step went from {before.step} to {after.step}, expected +1")
    touched = np.concatenate([hit_slots, dst])
    if np.any(after.usage[touched] != after.step):
        slot = int(touched[after.usage[touched] != after.step][0])
        _fail(f"slot {slot}, touched by this call, has usage {after.usage[slot]} != the "
              f"call's step {after.step}")
