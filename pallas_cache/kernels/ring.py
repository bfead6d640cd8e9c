"""The token ring (:class:`~pallas_cache.evictions.ring.TokenRingState`) inside the fused kernel
(kernels/step.py), for any eviction whose kernel hooks ask for per-call inputs
(``KernelRanking.per_call``): the call's bookkeeping written in place, and what the victim key
reads per call, computed, not stored: the neighbours' first uses as bit-sliced counters in a
scratch buffer, then per slot the occupant's predicted next use, protection and ring frequency
(:class:`~pallas_cache.evictions.base.PerCallInputs`; docs/semantics.md §5.16, §7).

The arithmetic is the XLA step's (:mod:`~pallas_cache.evictions.ring` and the evictions that
read it), integer for integer; only the layout differs: a
vector per ring position or per mask word, gathers from the refs (each of its leaf's own
shape) for the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache.evictions.base import PerCall, PerCallInputs
from pallas_cache.evictions.ring import NEIGHBOURS, TokenRingState
from pallas_cache.kernels import common
from pallas_cache.kernels.common import INT32_MIN

__all__ = ["RingCall", "RingPrediction", "RingRefs", "bitmask", "observe", "per_slot",
           "predict", "refs_of", "ring_from", "scratch_shape", "supports"]


class RingRefs(NamedTuple):
    """The ring's leaves as the kernel's refs, each of the leaf's own shape (``W`` = history,
    ``w = ceil(E / 32)``), each an input aliased to the output of the same name."""

    masks: Any  # u32[W, L, w]: TokenRingState.masks
    sim: Any  # i32[W]
    match: Any  # i32[W]
    head: Any  # i32[]
    count: Any  # i32[]
    last_layer: Any  # i32[]
    counts: tuple  # (i32[L, E],) when the ring keeps its counts; () otherwise


class RingCall(NamedTuple):
    """The ring after this call's bookkeeping, as the prediction reads it (in-kernel values)."""

    head: Any  # i32[]: the current token's ring position
    count: Any  # i32[]: tokens in the ring
    sim: Any  # i32[W']: similarity per ring position (W' = next_pow2(W))
    age: Any  # i32[W']: (head - position) mod W


class RingPrediction(NamedTuple):
    """What each slot's key reads: the neighbours found, the horizon, and the refs to gather."""

    found: Any  # i32[]: neighbours found (<= NEIGHBOURS)
    horizon: Any  # i32[]: H = ceil(S / L)
    layer: Any  # i32[]: the call's layer (clamped)
    call: RingCall
    planes: Any  # u32[P * w']: the first-use counters, plane b at [b * w', (b + 1) * w')
    #              (w' = next_pow2(L * w), entry m * w + t: layer m's mask word t)
    refs: RingRefs  # the ring as this call left it (the outputs)


def _words(ring) -> int:
    return ring.masks.shape[-1]


def supports(ring: TokenRingState) -> bool:
    """Whether the kernel holds the ring in single vectors: ``next_pow2(W)`` and
    ``next_pow2(L * w)`` at most :data:`~pallas_cache.kernels.common.MAX_BLOCK`. An eviction whose
    kernel hooks ask for per-call inputs must keep a token ring (TypeError otherwise)."""
    if not isinstance(ring, TokenRingState):
        raise TypeError(f"KernelRanking.per_call needs a TokenRingState as the eviction's "
                        f"bookkeeping, got {type(ring).__name__}")
    history, num_layers, words = ring.masks.shape
    return max(common.next_pow2(history),
               common.next_pow2(num_layers * words)) <= common.MAX_BLOCK


def refs_of(ring: TokenRingState) -> RingRefs:
    """The ring's leaves as they are (no reshape: see kernels/step.py's ``StateRefs``)."""
    return RingRefs(masks=ring.masks, sim=ring.sim, match=ring.match, head=ring.head,
                    count=ring.count, last_layer=ring.last_layer,
                    counts=() if ring.counts is None else (ring.counts,))


def ring_from(ring: TokenRingState, out: RingRefs) -> TokenRingState:
    """``ring`` with the kernel's outputs."""
    return TokenRingState(
        masks=out.masks, sim=out.sim, match=out.match, head=out.head, count=out.count,
        last_layer=out.last_layer, counts=out.counts[0] if out.counts else None)


def _num_neighbours(history: int) -> int:
    return min(NEIGHBOURS, history)


def _num_planes(history: int, num_layers: int, capacity: int) -> int:
    """Bits of the largest first-use count, ``NEIGHBOURS * ceil(C / L)``."""
    return (_num_neighbours(history) * -(-capacity // num_layers)).bit_length()


def scratch_shape(ring: TokenRingState, capacity: int):
    """The per-call buffer of the first-use counters, ``u32[P * next_pow2(L * w)]``, as its
    ``(shape, dtype)``."""
    history, num_layers, words = ring.masks.shape
    width = common.next_pow2(num_layers * words)
    return (_num_planes(history, num_layers, capacity) * width,), jnp.uint32


def _bit(word, position):
    """Bit ``position`` (int32 in [0, 32)) of uint32 ``word``, as int32 0/1."""
    return ((word >> position.astype(jnp.uint32)) & 1).astype(jnp.int32)


def _popcount(x):
    """Set bits of uint32 ``x``, as int32 (the bit-parallel sum: Triton's NVIDIA backend has no
    lowering of ``math.ctpop``)."""
    x = x - ((x >> 1) & jnp.uint32(0x55555555))
    x = (x & jnp.uint32(0x33333333)) + ((x >> 2) & jnp.uint32(0x33333333))
    x = (x + (x >> 4)) & jnp.uint32(0x0F0F0F0F)
    return ((x * jnp.uint32(0x01010101)) >> 24).astype(jnp.int32)


def bitmask(ids, mask, num_experts: int) -> list:
    """The call's mask words (uint32 each, ``ceil(E / 32)``): the bits of the experts ``ids``
    where ``mask``, each expert at most once (a route's first occurrence, or the layer's row)."""
    bit = jnp.uint32(1) << (ids % 32).astype(jnp.uint32)
    return [jnp.sum(jnp.where(mask & (ids // 32 == t), bit, jnp.uint32(0)), dtype=jnp.uint32)
            for t in range(-(-num_experts // 32))]


def observe(ring: RingRefs, out: RingRefs, *, layer, layer_c, routed, bits, e_idx, accepted,
            num_layers: int, num_experts: int, barrier) -> RingCall:
    """The ring after an accepted call of ``layer`` routing ``routed`` (bool[E'] over
    ``e_idx``; ``bits``: its mask words, :func:`bitmask`), written to ``out``; a refused call
    writes nothing. Every read of an entry another thread writes comes before ``barrier()`` and
    that write after it (the outputs alias the inputs): a token start if the layer does not
    increase, the call's bitmask recorded in the current token's row and matched against every
    past token's same layer, and, where the ring keeps its counts, the ring frequency following
    the changed row."""
    L, E = num_layers, num_experts
    history = ring.sim.shape[0]
    words = ring.masks.shape[2]
    w_pad = common.next_pow2(history)

    start = accepted & (layer <= ring.last_layer[...])
    head = jnp.where(start, (ring.head[...] + 1) % history, ring.head[...])
    count = jnp.where(start, jnp.minimum(ring.count[...] + 1, history), ring.count[...])

    # Per ring position j: at a token start sim_j takes the previous token's match_{j-1} (0 if
    # j-1 left the ring) and match restarts; then both add this layer's overlap with the call.
    j = lax.iota(jnp.int32, w_pad)
    in_ring = j < history
    at = jnp.minimum(j, history - 1)
    age = (head - j + history) % history
    sim = plgpu.load(ring.sim.at[j], mask=in_ring, other=0)
    match = plgpu.load(ring.match.at[j], mask=in_ring, other=0)
    aligned = plgpu.load(ring.match.at[(at + history - 1) % history], mask=in_ring, other=0)
    sim = jnp.where(start, jnp.where((age >= 1) & (age + 2 <= count), aligned, 0), sim)
    match = jnp.where(start, 0, match)
    past = accepted & in_ring & (age >= 1) & (age <= count - 1)
    common_bits = jnp.zeros((w_pad,), jnp.int32)
    for t in range(words):
        word = plgpu.load(ring.masks.at[at, layer_c, t], mask=past, other=0)
        common_bits = common_bits + _popcount(word & bits[t])
    sim = sim + 2 * common_bits
    match = match + common_bits

    if ring.counts:
        lfu_row = _lfu_counts(ring, out, head=head, start=start, layer_c=layer_c, routed=routed,
                              e_idx=e_idx, words=words, num_layers=L, num_experts=E)

    barrier()  # every read of the ring above before the writes below
    plgpu.store(out.sim.at[j], sim, mask=in_ring & accepted)
    plgpu.store(out.match.at[j], match, mask=in_ring & accepted)
    l_pad = common.next_pow2(L)
    m = lax.iota(jnp.int32, l_pad)
    written = (m < L) & accepted & (start | (m == layer_c))
    for t in range(words):
        common.scatter(out.masks, (head, m, t),
                       jnp.where(m == layer_c, bits[t], jnp.uint32(0)), written)
    if ring.counts:
        row, row_counts, e_ok = lfu_row
        common.scatter(out.counts[0], row, row_counts, e_ok & accepted)
    for ref, value in ((out.head, head), (out.count, count), (out.last_layer, layer)):
        plgpu.store(ref, value, mask=accepted)
    return RingCall(head=head, count=count, sim=sim, age=age)


def _lfu_counts(ring: RingRefs, out: RingRefs, *, head, start, layer_c, routed, e_idx,
                words: int, num_layers: int, num_experts: int):
    """The ring frequency (a ring that keeps its counts) in :func:`observe`, before its barrier:
    the other layers' entries written in place, the call's layer's row returned as
    ``(row, counts, e_ok)`` for ``observe`` to write after the barrier."""
    L, E = num_layers, num_experts
    # F follows the ring's one changed row R[T, ·] (the new head's): at a token start the
    # oldest token leaves (every layer's old bits subtracted), and the layer's word becomes
    # the call's bitmask.
    counts, counts_out = ring.counts[0], out.counts[0]
    e_ok = e_idx < E
    row = (layer_c, e_idx)
    old = plgpu.load(ring.masks.at[head, layer_c, e_idx // 32], mask=e_ok, other=0)
    row_counts = (plgpu.load(counts.at[row], mask=e_ok, other=0)
                  + routed.astype(jnp.int32) - _bit(old, e_idx % 32))
    width = min(common.next_pow2(L * E), common.MAX_BLOCK)

    def leave(b, carry):
        index = pl.multiple_of(b * width, width) + lax.iota(jnp.int32, width)
        m, e = index // E, index % E
        ok = (index < L * E) & (m != layer_c)
        word = plgpu.load(ring.masks.at[head, m, e // 32], mask=ok, other=0)
        # counts by the flat position (row and column: a division, as flat_index forms it)
        value = (plgpu.load(common.flat_at(counts, index), mask=ok, other=0)
                 - _bit(word, e % 32))
        plgpu.store(common.flat_at(counts_out, index), value, mask=ok)
        return carry

    # Each lane writes only the entry it read (the layer's own row is stored after the
    # barrier), so this pass needs none.
    blocks = jnp.where(start, jnp.int32(-(-(L * E) // width)), jnp.int32(0))
    lax.fori_loop(0, blocks, leave, jnp.int32(0))
    return row, row_counts, e_ok


def predict(call: RingCall, out: RingRefs, planes_ref, *, layer_c, size, searching,
            num_layers: int, capacity: int, barrier) -> RingPrediction:
    """The neighbours (the past tokens of largest ``(sim, token)``) and, per mask word of the
    ring, the bit-sliced count of ``(j, k)`` with ``k < H`` whose prefix ``P_jk`` (the neighbour
    ``j``'s seen routes over its next ``k + 1`` tokens, shifted by one for layers at or before
    this one) holds the expert, written to ``planes_ref`` before ``barrier()``. Reads the ring
    as :func:`observe` left it; does nothing unless ``searching``."""
    L = num_layers
    history = out.sim.shape[0]
    words = out.masks.shape[2]
    row_words = L * words
    w_pad = call.sim.shape[0]
    num = _num_neighbours(history)

    # Descending (sim, token) = ascending (-sim, age); ages are distinct.
    past = (lax.iota(jnp.int32, w_pad) < history) & (call.age >= 1) & (call.age <= call.count - 1)
    key = -call.sim
    p_idx = lax.iota(jnp.int32, common.next_pow2(num))

    def pick(k, carry):
        prev_key, prev_age, picks = carry
        (m,), a = common.lex_min((key,), call.age,
                                 past & common.after((key,), call.age, (prev_key,), prev_age))
        picks = jnp.where((p_idx == k) & (a != common.INT32_MAX), a, picks)
        return m, a, picks

    _, _, picks = lax.fori_loop(
        0, jnp.where(searching, jnp.int32(num), jnp.int32(0)), pick,
        (jnp.int32(INT32_MIN), jnp.int32(-1), jnp.full(p_idx.shape, -1, jnp.int32)))
    found = jnp.sum((picks >= 0).astype(jnp.int32))
    horizon = (size + L - 1) // L
    width = common.next_pow2(row_words)
    planes = _first_uses(out.masks, call.head, [common.lane(picks, n) for n in range(num)],
                         horizon, layer_c=layer_c, history=history, words=words,
                         width=width, num_planes=planes_ref.shape[0] // width)
    i_ok = lax.iota(jnp.int32, width) < row_words
    for b, plane in enumerate(planes):
        plgpu.store(planes_ref.at[pl.ds(b * width, width)], plane, mask=i_ok & searching)
    barrier()  # the counters before the pool scan's gathers of them by other threads
    return RingPrediction(found=found, horizon=horizon, layer=layer_c, call=call,
                          planes=planes_ref, refs=out)


def _add(planes, addend):
    """``planes + addend``, both bit-sliced (entry ``b``: bit ``b`` of every lane's count, the
    least significant first; ``None``: a zero word), by a ripple of full adders. The carry out
    of the top plane is dropped: every count the kernel forms fits the planes."""
    out, carry = [], None
    for b, x in enumerate(planes):
        a = addend[b] if b < len(addend) else None
        if a is None and carry is None:
            out.append(x)
        elif a is None or carry is None:
            y = carry if a is None else a
            out.append(x ^ y)
            carry = x & y
        else:
            half = x ^ a
            out.append(half ^ carry)
            carry = (x & a) | (half & carry)
    return out


def _sum_of(words):
    """The bit-sliced per-lane sum of up to three one-bit words (a carry-save adder)."""
    if len(words) == 1:
        return [words[0]]
    if len(words) == 2:
        return [words[0] ^ words[1], words[0] & words[1]]
    a, b, c = words
    return [a ^ b ^ c, (a & b) | (c & (a ^ b))]


def _times(total, t, num_planes: int):
    """``t * total`` bit-sliced, ``total`` a bit-sliced count of at most 3 per lane (one or two
    words, :func:`_sum_of`) and ``t`` a traced int32: each lane's product is one of ``t``,
    ``2 t``, ``3 t``, whose bits are scalars."""
    if len(total) == 1:
        lanes = {1: total[0]}
    else:
        s, c = total
        lanes = {1: s & ~c, 2: ~s & c, 3: s & c}
    out = []
    for b in range(num_planes):
        word = jnp.uint32(0)
        for value, at in lanes.items():
            word = word | jnp.where(((value * t >> b) & 1) == 1, at, jnp.uint32(0))
        out.append(word)
    return out


def _first_uses(masks, head, ages, horizon, *, layer_c, history: int, words: int, width: int,
                num_planes: int):
    """The bit-sliced counters of :func:`predict`: per mask word of the ring rows, the count
    over the neighbours (their ring ages ``ages``; -1: none) and ``k < H`` of the prefixes
    ``P_jk`` holding each bit.

    Neighbour ``j`` of age ``a`` reads the rows of ages ``a, a - 1, ..., 0`` (its next tokens up
    to the current one); from ``k = a`` on its prefix no longer changes. So the loop runs
    ``R = max_j min(H, a_j)`` rounds, at most ``min(H, W - 1)``, for all the neighbours at once,
    each adding their prefixes through one carry-save adder; the ``H - R`` rounds that would
    add the same prefixes again are one multiply-add. A round's ring rows were loaded in the
    round before, so no round waits on a load it issued."""
    row_words = masks.shape[1] * words
    i = lax.iota(jnp.int32, width)
    i_ok = i < row_words
    at_word = (i, 0) if words == 1 else (lax.div(i, words), lax.rem(i, words))
    shifted = (i // words) <= layer_c  # layer m was already called in this token
    zero = jnp.zeros((width,), jnp.uint32)
    rounds = [jnp.where(a >= 0, jnp.minimum(horizon, a), jnp.int32(0)) for a in ages]
    total = rounds[0]
    for r in rounds[1:]:
        total = jnp.maximum(total, r)

    def row(age, ok):
        """The ring row of the token of age ``age`` (0: the current token)."""
        return plgpu.load(masks.at[(head - age + history) % history, at_word[0], at_word[1]],
                          mask=i_ok & ok, other=0)

    def first_uses(k, carry):
        # Per neighbour: the rows of tokens j + k and j + k + 1, and the prefix.
        carry = list(carry)
        prefixes = []
        for n, (age, r) in enumerate(zip(ages, rounds)):
            word, nxt, prefix = carry[3 * n:3 * n + 3]
            prefix = prefix | jnp.where(k < r, jnp.where(shifted, nxt, word), zero)
            carry[3 * n:3 * n + 3] = nxt, row(age - k - 2, k + 1 < r), prefix
            prefixes.append(prefix)
        return (*carry[:3 * len(ages)],
                *_add(carry[3 * len(ages):], _sum_of(prefixes)))

    start = []
    for age, r in zip(ages, rounds):
        start += [row(age, r > 0), row(age - 1, r > 0), zero]
    carry = lax.fori_loop(0, total, first_uses, (*start, *([zero] * num_planes)))
    planes = tuple(carry[3 * len(ages):])
    prefixes = [carry[3 * n + 2] for n in range(len(ages))]
    # With no round run no prefix holds a bit: a call that does not search skips the tail.
    return lax.cond(total > 0,
                    lambda: tuple(_add(planes, _times(_sum_of(prefixes), horizon - total,
                                                      num_planes))),
                    lambda: planes)


def per_slot(pred: RingPrediction | None, occupant, valid, names: tuple[PerCall, ...], *,
             num_layers: int, num_experts: int) -> PerCallInputs | None:
    """The per-call inputs of the victim key for a block of slots (``occupant`` -1 when free;
    ``valid``: the lanes read), int32 each, those in ``names`` (the others ``None``):
    ``next_use`` (``found * distance + L * steps``, ``steps`` the neighbours' first uses within
    ``H``), ``prot`` and ``freq``. ``None`` without a prediction (no token ring)."""
    if pred is None:
        return None
    L, E = num_layers, num_experts
    history = pred.refs.sim.shape[0]
    words = pred.refs.masks.shape[2]
    width = common.next_pow2(L * words)
    occ = jnp.maximum(occupant, 0)
    m, e = occ // E, occ % E
    word_at = m * words + e // 32
    next_use = prot = freq = None
    if PerCall.NEXT_USE in names:
        uses = jnp.zeros(occupant.shape, jnp.int32)
        for b in range(pred.planes.shape[0] // width):
            word = plgpu.load(pred.planes.at[b * width + word_at], mask=valid, other=0)
            uses = uses + (_bit(word, e % 32) << b)
        distance = (m - pred.layer - 1 + L) % L + 1
        next_use = pred.found * distance + L * (pred.found * pred.horizon - uses)
    if PerCall.PROT in names:
        # Routed by the latest call of its layer the ring holds: this token's for layers up to
        # this one, the previous token's after it.
        mine = m <= pred.layer
        position = jnp.where(mine, pred.call.head, (pred.call.head - 1 + history) % history)
        word = plgpu.load(pred.refs.masks.at[position, m, e // 32],
                          mask=valid & (mine | (pred.call.count >= 2)), other=0)
        prot = _bit(word, e % 32)
    if PerCall.FREQ in names:
        freq = plgpu.load(pred.refs.counts[0].at[m, e], mask=valid, other=0)
    return PerCallInputs(num_layers=L, next_use=next_use, prot=prot, freq=freq)
