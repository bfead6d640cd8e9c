"""The token ring of ``Eviction.ROUTE_KNN`` and ``Eviction.ROUTE_LFU``: the last ``W`` tokens'
routes as bitmasks, each past token's similarity to the current one and (ROUTE_LFU) how many ring
tokens routed each expert, kept by exact integer arithmetic, loop-free (docs/semantics.md §5.16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from pallas_cache.tree import Record, pytree_dataclass, varying_like

#: The similar past tokens ROUTE_KNN's and ROUTE_LFU's next use is predicted from (``K``), in
#: the XLA step and the fused kernel alike.
NEIGHBOURS = 3


@pytree_dataclass
class TokenRingState(Record):
    """The token ring ROUTE_KNN and ROUTE_LFU keep (docs/semantics.md §5.16); ``W`` =
    ``history`` tokens.

    Attributes:
      masks: uint32[W, L, ceil(E/32)]. ``R``: per ring position (token ``t`` at ``t mod W``) and
        layer, the bitmask of the experts that token's call to the layer routed (bit ``e % 32`` of
        word ``e // 32``); all zero for a layer the token did not call.
      sim: int32[W]. Similarity of the token at each ring position to the current token (0 for
        the current token and for positions holding no past token).
      match: int32[W]. Per ring position ``j``, ``sum_m popcount(R[j, m] & R[T, m])`` over the
        current token's calls so far (past tokens only): at the next token start it becomes the
        aligned part of ``sim`` (``sim_{j+1}``), so no start rescans the ring.
      head: int32[]. Ring position of the current token ``T``.
      count: int32[]. Tokens in the ring, the current one included (``min(T + 1, W)``).
      last_layer: int32[]. The layer of the last accepted call (-1 before any, ``L`` after
        :func:`start_token`): a call to a layer ``<=`` it starts a token.
      counts: int32[L, E] under ROUTE_LFU, ``None`` (no leaves) under ROUTE_KNN. ``F``: how many
        tokens of the ring routed each expert, kept in step with ``masks`` (a token leaving the
        ring subtracts its routes, a call adds its own) so the ranking need not recount the ring.
    """

    masks: jax.Array
    sim: jax.Array
    match: jax.Array
    head: jax.Array
    count: jax.Array
    last_layer: jax.Array
    counts: jax.Array | None = None


def init(num_layers: int, num_experts: int, history: int, *, counts: bool) -> TokenRingState:
    """The ring of a cold cache; ``counts``: keep ROUTE_LFU's per-expert ring frequency."""
    words = -(-num_experts // 32)
    return TokenRingState(
        masks=jnp.zeros((history, num_layers, words), jnp.uint32),
        sim=jnp.zeros((history,), jnp.int32), match=jnp.zeros((history,), jnp.int32),
        head=jnp.zeros((), jnp.int32), count=jnp.ones((), jnp.int32),
        last_layer=jnp.full((), -1, jnp.int32),
        counts=jnp.zeros((num_layers, num_experts), jnp.int32) if counts else None)


def history_of(ring: TokenRingState) -> int:
    """The ring size ``W``."""
    return ring.masks.shape[-3]


def start_token(ring: TokenRingState, num_layers: int) -> TokenRingState:
    """The ring with the next accepted call starting a token, whatever its layer."""
    return ring.replace(last_layer=jnp.full((), num_layers, jnp.int32))


def ring_bits(masks, num_experts: int):
    """The ring as bool[..., W, L, E] (host views and tests)."""
    return unpacked(masks, num_experts).astype(jnp.bool_)


def unpacked(masks, num_experts: int):
    """Bitmask words ``[..., ceil(E/32)]`` as int32 0/1 ``[..., E]``."""
    bits = (masks[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(masks.shape[:-1] + (-1,))[..., :num_experts].astype(jnp.int32)


def branches_on_cpu(ring) -> bool:
    """Whether XLA:CPU runs the ring's bookkeeping, and ROUTE_KNN its prediction table, as
    conditionals (:func:`cpu_branch`): with one mask word per layer (``E <= 32``; measured at
    Mixtral's L=32 E=8, faster loaded or not). At the fine-grained L=48 E=128 the straight-line
    forms, whose ops XLA:CPU spreads over a free core, measured faster."""
    return ring.masks.shape[-1] == 1


def cpu_branch(pred, fn, skipped, *operands):
    """``fn(*operands)``, which must equal ``skipped(*operands)`` where ``pred`` is false: on
    XLA:CPU one ``lax.cond`` on ``pred`` (docs/design.md, "ROUTE_KNN's per-call cost"), the same
    integers everywhere. Under ``vmap`` and on other platforms (where a conditional reads its
    predicate on the host), ``fn`` alone. ``fn`` and ``skipped`` close over no traced value:
    everything traced is an operand."""
    @custom_vmap
    def run(pred, *operands):
        # Inside a shard_map both branches vary over the axes of the predicate and operands.
        on_cpu = lambda pred, *ops: lax.cond(  # noqa: E731
            pred, lambda *ops: varying_like(fn(*ops), pred, ops),
            lambda *ops: varying_like(skipped(*ops), pred, ops), *ops)
        return lax.platform_dependent(pred, *operands, cpu=on_cpu,
                                      default=lambda pred, *ops: fn(*ops))

    @run.def_vmap
    def run_vmap(axis_size, in_batched, pred, *operands):
        in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched[1:]))
        out = jax.vmap(fn, in_axes=in_axes, axis_size=axis_size)(*operands)
        return out, jax.tree.map(lambda _: True, out)

    return run(pred, *operands)


def observe(ring, layer, routed, accepted):
    """The ring after an accepted call of ``layer`` routing ``routed`` (bool[E]): a token start
    if the layer does not increase (re-aligned similarities), then the call's bitmask recorded
    and matched against every past token's same layer; a refused call changes nothing."""
    if not branches_on_cpu(ring):
        return _observe_token(ring, layer, routed, accepted)
    return cpu_branch(accepted, _observe_token, lambda ring, *_: ring, ring, layer, routed,
                      accepted)


def _popcount_sum(a, b, axes):
    return jnp.sum(lax.population_count(a & b).astype(jnp.int32), axis=axes)


def _observe_token(ring, layer, routed, accepted):
    """:func:`observe` as straight-line code."""
    history, _, words = ring.masks.shape
    start = accepted & (layer <= ring.last_layer)
    head = jnp.where(start, (ring.head + 1) % history, ring.head)
    count = jnp.where(start, jnp.minimum(ring.count + 1, history), ring.count)
    # The row of T, R[T, ·]: cleared at a token start (the oldest token leaves), then R[T, l] = b.
    # Built apart and written back with one update: each in-place update of the ring that
    # another op of the step still reads costs XLA a copy of the whole ring.
    old_row = ring.masks[head]  # [L, w]
    row = jnp.where(start, jnp.uint32(0), old_row)
    age = (head - lax.iota(jnp.int32, history)) % history  # 0 = the current token
    # At a token start: sim_j = sum_m popcount(R[j-1, m] & R[T-1, m]), 0 if j-1 left the ring;
    # the previous token's calls accumulated exactly that as match_{j-1}.
    aligned = jnp.roll(ring.match, 1)
    sim = jnp.where(start, jnp.where((age >= 1) & (age + 2 <= count), aligned, 0), ring.sim)
    match = jnp.where(start, 0, ring.match)
    # Record the call's bitmask b in R[T, layer]; sim_j += 2 * popcount(R[j, layer] & b).
    padded = jnp.zeros((words * 32,), jnp.uint32).at[:routed.shape[0]].set(routed)
    bitmask = jnp.sum(padded.reshape(words, 32) << jnp.arange(32, dtype=jnp.uint32), axis=1,
                      dtype=jnp.uint32)
    # Every write below is gated by `accepted` on its own (a refused call changes nothing),
    # rather than one select over the whole ring.
    row = row.at[layer].set(jnp.where(accepted, bitmask, row[layer]))
    masks = lax.dynamic_update_slice(ring.masks, row[None], (head, jnp.int32(0), jnp.int32(0)))
    counts = ring.counts
    if counts is not None:  # ROUTE_LFU: F follows the ring, whose one changed row is R[T, ·]
        experts = counts.shape[1]
        counts = counts + unpacked(row, experts) - unpacked(old_row, experts)
    past = accepted & (age >= 1) & (age <= count - 1)
    common = jnp.where(past, _popcount_sum(masks[:, layer], bitmask[None], 1), 0)
    return TokenRingState(masks=masks, sim=sim + 2 * common, match=match + common, head=head,
                         count=count, last_layer=jnp.where(accepted, layer, ring.last_layer),
                         counts=counts)
