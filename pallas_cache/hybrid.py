"""The hybrid MoE layer: the plan's CPU experts run on the host CPU (docs/semantics.md §5.13)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import compute_on as _compute_on

from pallas_cache.hints import IndexLike, PyTree
from pallas_cache.plans import EnsurePlan
from pallas_cache.moe import (bank_rank_message, check_bank_layer, check_bank_rank, check_routes,
                              copy_host_rows, gather_rows, memory_space, to_space)
from pallas_cache.tree import varying_like

__all__ = [
    "HOST_COMPUTE",
    "CpuExperts",
    "cpu_experts",
    "cpu_partial",
    "device_partial",
    "moe_hybrid",
]

#: The ``compute_on`` placement of the CPU partial: ops in it carry XLA's host compute type.
HOST_COMPUTE = "device_host"

# ``compute_on`` is a context manager around jitted calls up to jax 0.11.1 and a function
# transform, ``compute_on(f, *, compute_type, out_memory_spaces)``, from 0.11.2 on (0.10's
# ``compute_on2``): the installed form is decided once, here, by its signature.
_COMPUTE_ON_TRANSFORM = "out_memory_spaces" in inspect.signature(_compute_on.compute_on).parameters


def _on_host(f: Callable, out_space) -> Callable:
    """``f`` placed with ``compute_on(HOST_COMPUTE)`` by the installed JAX's form; its one array
    result stays in memory ``out_space`` (a ``jax.memory.Space``; None: device memory)."""
    if not _COMPUTE_ON_TRANSFORM:
        def placed(*args):
            with _compute_on.compute_on(HOST_COMPUTE):
                return jax.jit(f)(*args)
        return placed
    space = jax.memory.Space.Device if out_space is None else out_space
    return _compute_on.compute_on(f, compute_type=HOST_COMPUTE, out_memory_spaces=space)


class CpuExperts(NamedTuple):
    """The distinct experts a plan sends to the CPU, and each token's gate on each of them.

    Attributes:
      ids: int32 ``[K']`` layer-local expert ids, ascending, then ``-1`` (``K' = min(K, E)``).
      count: int32 ``[]``, how many entries of ``ids`` are valid.
      gates: ``[T, K']``: ``gates[t, j]`` sums token ``t``'s router gates on ``ids[j]`` over its
        CPU routes (0 where the token does not route there, and for padding columns).
      routed: bool ``[T, K']``: whether token ``t`` routes to ``ids[j]`` on the CPU. Only these
        pairs contribute: another token's output of that expert is never multiplied by its zero
        gate (``inf * 0`` and ``nan * 0`` are NaN; ``moe_dense`` masks the same way).
    """

    ids: jax.Array
    count: jax.Array
    gates: jax.Array
    routed: jax.Array


def _token_routes(x, expert_ids, gates):
    """``x [..., H]``, routes and gates ``[..., k]`` -> ``[T, H]``, ``[T, k]``, ``[T, k]``."""
    expert_ids, gates = check_routes(x, expert_ids, gates)
    k = expert_ids.shape[-1]
    return (x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, k).astype(jnp.int32),
            gates.reshape(-1, k))


def _plan_routes(plan, expert_ids, field):
    value = jnp.asarray(getattr(plan, field))
    if value.shape != jnp.shape(expert_ids):
        raise ValueError(f"plan.{field} {value.shape} differs from expert_ids "
                         f"{jnp.shape(expert_ids)} in shape")
    return value.reshape(-1, jnp.shape(expert_ids)[-1])


def _distinct(values, take, gates, size: int, width: int) -> CpuExperts:
    """The distinct ``values`` (in ``[0, size)``) of the routes in ``take``, ascending and
    ``-1``-padded to ``width``, their count, and each token's summed gate on each of them.
    Fixed-size and loop-free (a one-hot over ``size``)."""
    onehot = take[..., None] & (values[..., None] == jnp.arange(size, dtype=jnp.int32))
    marked = jnp.any(onehot, axis=(0, 1))  # [size]
    (chosen,) = jnp.nonzero(marked, size=width, fill_value=-1)
    chosen = chosen.astype(jnp.int32)
    per_value = jnp.sum(jnp.where(onehot, gates[..., None], 0), axis=1)  # [T, size]
    token_gates = jnp.where(chosen >= 0, per_value[:, jnp.maximum(chosen, 0)], 0)
    routed = (chosen >= 0) & jnp.any(onehot, axis=1)[:, jnp.maximum(chosen, 0)]  # [T, width]
    return CpuExperts(chosen, jnp.sum(marked, dtype=jnp.int32), token_gates.astype(gates.dtype),
                      routed)


def cpu_experts(plan, expert_ids, gates, num_experts: int) -> CpuExperts:
    """The distinct experts ``plan`` marks ``cpu``, ascending, with the per-token gates.

    Fixed-size and loop-free (a one-hot over the ``E`` experts), so it runs on the device inside
    the step without a host sync. A route is a CPU route when ``plan.cpu`` is set and its id is
    in ``[0, E)`` (``ensure_hybrid`` never marks another).

    Args:
      plan: an ``EnsurePlan`` of ``ensure``/``ensure_hybrid`` for ``expert_ids``.
      expert_ids: int ``[..., k]``, the routes the plan was made for (``-1`` = padding).
      gates: ``[..., k]`` router weights.
      num_experts: ``E`` (static).
    """
    ids = jnp.asarray(expert_ids).reshape(-1, jnp.shape(expert_ids)[-1]).astype(jnp.int32)
    gates = jnp.asarray(gates).reshape(ids.shape)
    cpu = _plan_routes(plan, expert_ids, "cpu") & (ids >= 0)
    return _distinct(ids, cpu, gates, num_experts, min(ids.size, num_experts))


def _bank_row(host_bank, layer, expert):
    """One expert's weights, sliced where the bank lives (host memory inside the host region).

    A bank in host memory is sliced by :func:`~pallas_cache.moe.copy_host_rows`, whose
    ``vmap`` rule turns a batch (of plans, layers or banks) into more rows of its loop: batching
    a ``dynamic_slice`` makes a gather whose index JAX builds in device memory, which it refuses
    beside a host operand."""
    def row(leaf):
        if _is_host(leaf):
            rows = jnp.reshape(expert, (1,))
            return copy_host_rows(leaf, rows, layer, memory_space(leaf))[0]
        lead = (expert,) if layer is None else (layer, expert)
        start = lead + (jnp.int32(0),) * (leaf.ndim - len(lead))
        piece = lax.dynamic_slice(leaf, start, (1,) * len(lead) + leaf.shape[len(lead):])
        return piece.reshape(leaf.shape[len(lead):])

    return jax.tree.map(row, host_bank)


def _is_host(leaf) -> bool:
    space = memory_space(leaf)
    return space is not None and space == getattr(getattr(jax, "memory", None), "Space",
                                                  None).Host


def _experts_on_tokens(tokens, chosen, token_gates, routed, host_bank, expert_fn, layer, n,
                       space, in_place):
    """``sum_j token_gates[:, j] * expert_fn(W[chosen[j]], tokens)`` over the first ``n`` (static)
    experts and the tokens ``routed[:, j]`` marks: each expert read once from the bank and
    applied to every token as one matrix product, whose rows for the other tokens are masked
    out (not multiplied by 0: an overflow or a NaN there would turn the sum into NaN).

    With ``in_place`` an ``expert_fn`` that has ``on_tokens`` (the library's,
    :class:`~pallas_cache.experts.Expert`) reads each expert where it lies in the bank; any
    other is given the expert's rows sliced out of the bank."""
    on_tokens = getattr(expert_fn, "on_tokens", None) if in_place else None
    out = None
    for j in range(n):
        if on_tokens is not None:
            index = (chosen[j],) if layer is None else (layer, chosen[j])
            y = on_tokens(host_bank, index, tokens)  # [T, H]
        else:
            weights = _bank_row(host_bank, layer, chosen[j])
            y = jax.vmap(expert_fn, in_axes=(None, 0))(weights, tokens)  # [T, H]
        _check_expert_output(y, tokens)
        zero = to_space(jnp.zeros((), y.dtype), space)
        term = jnp.where(routed[:, j:j + 1], token_gates[:, j:j + 1].astype(y.dtype) * y, zero)
        out = term if out is None else out + term
    return out


def _check_expert_output(y, tokens):
    """``expert_fn`` must map a token ``[H]`` to an output ``[H']``; name the shape it gave."""
    if y.ndim != 2 or y.shape[0] != tokens.shape[0]:
        raise ValueError(f"expert_fn(weights, x_row) must return one output row [H'] per token "
                         f"row x_row {list(tokens.shape[1:])}, got shape "
                         f"{list(y.shape[1:])}")


def cpu_partial(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, plan: EnsurePlan,
                host_bank: PyTree, expert_fn: Callable[[Any, jax.Array], jax.Array], *,
                layer: IndexLike | None = None) -> jax.Array:
    """The plan's CPU partial: its distinct CPU experts, computed on the host CPU.

    The distinct CPU experts (:func:`cpu_experts`) and the tokens go to the host; there a
    ``lax.switch`` on their count runs the branch that reads exactly that many experts from the
    bank and applies each to the tokens, so the host work is proportional to the number of
    distinct CPU experts (none when the plan has none); the ``[..., H]`` result comes back to the
    device. The region is placed with ``compute_on("device_host")``: its ops carry XLA's host
    compute type in the lowered program, for every backend (on the CPU backend the host is the
    device). Pure and jittable, with a traced layer.

    Args:
      x: ``[..., H]`` token activations.
      expert_ids: int ``[..., k]``, the routes the plan was made for (``-1`` = padding).
      gates: ``[..., k]`` router weights.
      plan: the ``EnsurePlan`` of ``ensure_hybrid`` for ``expert_ids``.
      host_bank: leaves ``[E, ...]``, or ``[L, E, ...]`` with ``layer=``; host memory
        (``put_host_bank``) or device memory.
      expert_fn: ``expert_fn(weights, x_row) -> y_row`` for one expert and one token ``[H]``.
      layer: optional int (possibly traced) layer index into a whole-model bank.

    Returns:
      ``[..., H]``: the gate-weighted sum over the plan's CPU routes (zeros when there are none,
      and for a traced ``layer`` outside the bank's ``[0, L)``, which reads no row, as
      ``apply_copy_plan`` copies nothing for it; a concrete one raises ``ValueError``). Only a
      token's own routes contribute: an expert's output on a token that did not choose it is
      masked, never multiplied by a zero gate.

    Raises:
      TypeError: non-integer ``expert_ids``; an ``expert_fn`` that returns a pytree.
      ValueError: an ``expert_fn`` whose output is not one row ``[H']`` per token row.
    """
    _check_bank_rank(host_bank, layer, expert_fn, x, getattr(plan.copy, "num_experts", None))
    layer = check_bank_layer(host_bank, layer)
    tokens, ids, _ = _token_routes(x, expert_ids, gates)
    axis = 0 if layer is None else 1
    num_experts = jax.tree.leaves(host_bank)[0].shape[axis]
    _check_bank(plan, host_bank, layer)
    chosen = cpu_experts(plan, expert_ids, gates, num_experts)
    bank_space = memory_space(jax.tree.leaves(host_bank)[0])
    count, layer_index = chosen.count, jnp.int32(0)
    if layer is not None:
        # A traced layer outside the bank reads no row and adds nothing, as apply_copy_plan
        # copies nothing for it (a slice would clamp it onto the last layer).
        layer_ok = _layer_in_bank(host_bank, layer)
        count = jnp.where(layer_ok, count, 0)
        layer_index = jnp.where(layer_ok, layer, 0)
    # The region's inputs go to where the bank lives (host memory for a host bank), so every op
    # in it reads one memory space; its result returns to the activations' space.
    inputs = [to_space(v, bank_space)
              for v in (tokens, chosen.ids, count, chosen.gates, chosen.routed, layer_index)]
    partial = _on_host(_one_at_a_time(functools.partial(
        _switch_partial, expert_fn=expert_fn, has_layer=layer is not None, space=bank_space,
        in_place=True), layer is not None), bank_space)(host_bank, *inputs)
    partial = to_space(partial, memory_space(x))
    return partial.reshape(x.shape[:-1] + partial.shape[-1:])


def _one_at_a_time(partial: Callable, has_layer: bool) -> Callable:
    """``partial(bank, tokens, chosen_ids, count, token_gates, routed, layer_index)`` (a
    :func:`_switch_partial`) whose ``vmap`` runs it once per batch element, in a ``lax.map``.

    Batching its ``lax.switch`` on a batched count would turn the switch into a select that runs
    every branch for every element: each element would read every count's experts. Mapped, each
    element runs its own branch and reads its own experts only. A batched bank (or pool) is not
    sliced per element (a copy of the whole of it): its batch axis is merged into the next one
    (``[B, N, ...] -> [B * N, ...]``, free) and the element's expert ids (or, with a layer axis,
    its layer index) are offset into it."""
    @custom_vmap
    def run(bank, *small):
        return partial(bank, *small)

    @run.def_vmap
    def _run_vmap(axis_size, in_batched, bank, *small):
        bank_leaves, bank_tree = jax.tree.flatten(bank)
        bank_batched = any(jax.tree.leaves(in_batched[0]))
        rows = 0
        if bank_batched:
            leaves = [leaf if batched else jnp.broadcast_to(leaf, (axis_size,) + leaf.shape)
                      for leaf, batched in zip(bank_leaves, jax.tree.leaves(in_batched[0]))]
            rows = leaves[0].shape[1]
            bank = jax.tree.unflatten(bank_tree, [
                leaf.reshape((axis_size * leaf.shape[1],) + leaf.shape[2:]) for leaf in leaves])
        batched = list(in_batched[1:])
        mapped = [value for value, b in zip(small, batched) if b]

        def one(inputs):
            element, values = inputs
            values = iter(values)
            args = [next(values) if b else value for value, b in zip(small, batched)]
            if bank_batched:  # ids (or the layer) into the merged axis
                which = 5 if has_layer else 1
                args[which] = args[which] + element * rows
            return run(bank, *args)

        return lax.map(one, (jnp.arange(axis_size, dtype=jnp.int32), mapped)), True

    return run


def _switch_partial(bank, tokens, chosen_ids, count, token_gates, routed, layer_index, *,
                    expert_fn, has_layer, space, in_place):
    """``[T, H]`` in memory ``space``: a ``lax.switch`` on ``count`` whose branch ``n`` reads the
    rows of ``chosen_ids[:n]`` from ``bank`` (``[L, E, ...]`` leaves when ``has_layer``, else
    ``[N, ...]``) and applies each to the tokens ``routed`` marks (:func:`_experts_on_tokens`,
    ``in_place`` there); branch 0 is zeros."""
    axis = 1 if has_layer else 0
    out = jax.eval_shape(
        lambda w, t: jax.vmap(expert_fn, in_axes=(None, 0))(w, t),
        jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape[axis + 1:], b.dtype), bank),
        jax.ShapeDtypeStruct(tokens.shape, tokens.dtype))
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(f"expert_fn(weights, x_row) must return one array [H'] per token row "
                        f"x_row {list(tokens.shape[1:])}, got the pytree {out}")
    _check_expert_output(out, tokens)

    def branch(n):
        def run(tokens, chosen_ids, token_gates, routed, layer_index):
            if n == 0:
                zeros = to_space(jnp.zeros(out.shape, out.dtype), space)
                return varying_like(zeros, bank, tokens, chosen_ids, token_gates, routed,
                                     layer_index if has_layer else None)
            return _experts_on_tokens(tokens, chosen_ids, token_gates, routed, bank, expert_fn,
                                      layer_index if has_layer else None, n, space, in_place)
        return run

    return lax.switch(count, [branch(n) for n in range(chosen_ids.shape[0] + 1)], tokens,
                      chosen_ids, token_gates, routed, layer_index)


def _layer_in_bank(host_bank, layer):
    """bool ``[]``: ``layer`` (int32, possibly traced) is in ``[0, L)`` of every bank leaf."""
    num_layers = min(leaf.shape[0] for leaf in jax.tree.leaves(host_bank))
    return (layer >= 0) & (layer < num_layers)


def _check_bank_rank(host_bank, layer, expert_fn, x, num_experts):
    """Name a whole-model bank without ``layer=`` (or a one-layer bank with it): the plan's
    ``num_experts`` (when known) is the leaf's axis at the other rank and not at the one given,
    or ``expert_fn`` maps a token row ``[H]`` to a row ``[H']`` with the bank's rows read at the
    other rank and not at the one given (only shapes are evaluated)."""
    given = 1 if layer is None else 2
    for leaf in jax.tree.leaves(host_bank):
        if (num_experts is not None and leaf.ndim >= 2 and leaf.shape[given - 1] != num_experts
                and leaf.shape[2 - given] == num_experts):
            raise ValueError(bank_rank_message(
                leaf.shape, layer is not None, f"the plan's {num_experts} experts are its axis "
                                               f"{2 - given}"))
    token = jax.ShapeDtypeStruct(x.shape[-1:], x.dtype)

    def maps(skip):
        rows = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape[skip:], b.dtype), host_bank)
        try:
            out = jax.eval_shape(expert_fn, rows, token)
        except Exception:  # noqa: BLE001 - a shape the function cannot take
            return False
        return isinstance(out, jax.ShapeDtypeStruct) and out.ndim == 1

    if not maps(given) and maps(3 - given):
        shape = jax.tree.leaves(host_bank)[0].shape
        raise ValueError(bank_rank_message(
            shape, layer is not None, f"expert_fn maps its rows {list(shape[3 - given:])} to one "
                                      f"row, not {list(shape[given:])}"))


def _check_bank(plan, host_bank, layer):
    """The bank's expert axis against the plan's ``num_experts`` (pool not involved here)."""
    num_experts = getattr(plan.copy, "num_experts", None)
    axis = 0 if layer is None else 1
    for leaf in jax.tree.leaves(host_bank):
        if num_experts is not None and leaf.shape[axis] != num_experts:
            raise ValueError(f"the plan is for {num_experts} experts per layer, but a host bank "
                             f"leaf has shape {tuple(leaf.shape)} ({leaf.shape[axis]} rows on "
                             f"its expert axis {axis})")


def device_partial(x, expert_ids, gates, plan, pool,
                   expert_fn: Callable[[Any, jax.Array], jax.Array]):
    """The plan's device partial: the distinct slots of its device routes (``plan.slots >= 0``),
    each expert read once from the pool (after :func:`~pallas_cache.moe.apply_copy_plan`) and
    applied to the tokens, by the same switch on their count as :func:`cpu_partial`, on the
    device; other routes add 0.

    Returns:
      ``[..., H]``, the gate-weighted sum over the device routes.
    """
    tokens, ids, gate = _token_routes(x, expert_ids, gates)
    slots = _plan_routes(plan, expert_ids, "slots").astype(jnp.int32)
    num_slots = getattr(plan.copy, "num_slots", None)
    for leaf in jax.tree.leaves(pool):
        if num_slots is not None and leaf.shape[0] != num_slots:
            raise ValueError(f"the plan is for a pool of {num_slots} slots, but a pool leaf has "
                             f"shape {tuple(leaf.shape)} ({leaf.shape[0]} slots)")
    pool_slots = jax.tree.leaves(pool)[0].shape[0]
    num_experts = getattr(plan.copy, "num_experts", None) or ids.size
    # A layer-call's distinct slots never exceed its distinct experts, min(K, E).
    chosen = _distinct(slots, slots >= 0, gate, pool_slots, min(ids.size, num_experts, pool_slots))
    space = memory_space(jax.tree.leaves(pool)[0])
    # On the CPU backend the pool is host memory: the library's experts read it in place there.
    in_place = jax.default_backend() == "cpu"
    partial = _one_at_a_time(functools.partial(
        _switch_partial, expert_fn=expert_fn, has_layer=False, space=space, in_place=in_place),
        False)(
        pool, *[to_space(v, space) for v in (tokens, chosen.ids, chosen.count, chosen.gates,
                                              chosen.routed, jnp.int32(0))])
    partial = to_space(partial, memory_space(x))
    return partial.reshape(x.shape[:-1] + partial.shape[-1:])


def moe_hybrid(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, plan: EnsurePlan,
               pool: PyTree, host_bank: PyTree, expert_fn: Callable[[Any, jax.Array], jax.Array],
               *, layer: IndexLike | None = None) -> jax.Array:
    """The hybrid MoE output of a plan: :func:`device_partial` + :func:`cpu_partial`.

    Call it after :func:`~pallas_cache.moe.apply_copy_plan` has applied ``plan`` to ``pool``;
    for a correct plan it equals ``moe_dense`` up to float rounding. A whole-model bank without
    ``layer=`` (or one layer's bank with it) raises ``ValueError`` saying so.
    """
    check_bank_rank(host_bank, layer, pool)
    return (device_partial(x, expert_ids, gates, plan, pool, expert_fn)
            + cpu_partial(x, expert_ids, gates, plan, host_bank, expert_fn, layer=layer))
