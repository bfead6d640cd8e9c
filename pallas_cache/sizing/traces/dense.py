"""Dense routing arrays ``[tokens, layers, top_k]`` (one per sequence) validated and laid out as a
trace's fields, token-major: what :meth:`Trace.from_dense
<pallas_cache.sizing.traces.base.Trace.from_dense>` and the NumPy readers build a trace from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pallas_cache.sizing.traces.errors import TraceError
from pallas_cache.sizing.traces.geometry import (OUTLIER_FLOOR, check_geometry, check_outlier,
                                                 id_past_int32, next_largest,
                                                 optional_positive_int)
from pallas_cache.sizing.traces.memory import check_memory, resolve_memory_limit, trace_bytes
from pallas_cache.validate import INT32_MAX

__all__ = ["ArrayMember", "assemble_dense", "check_member", "dense_fields"]


@dataclass(frozen=True)
class ArrayMember:
    """One ``[tokens, layers, top_k]`` array of a NumPy trace file, known from its header."""

    name: str            # the array's name ('routes' for a .npy)
    label: str           # "file: array 'name'", for messages
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    read: Any            # () -> np.ndarray, reading the data (or returning the array)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * self.dtype.itemsize


def check_member(member: ArrayMember, tokens: str = "tokens", empty_tokens: bool = False) -> None:
    """Dtype, rank and emptiness, from the header alone (``empty_tokens``: a first dimension of
    0 is allowed)."""
    if member.dtype.kind not in "iu":
        raise TraceError(f"{member.label}: expected an integer array of expert ids, got dtype "
                         f"{member.dtype} (shape {member.shape})")
    if len(member.shape) != 3:
        raise TraceError(f"{member.label}: expected shape [{tokens}, layers, top_k], got "
                         f"{len(member.shape)}-D shape {member.shape}")
    if 0 in member.shape[empty_tokens:]:
        raise TraceError(f"{member.label}: the trace is empty (shape {member.shape})")


def dense_fields(dense: np.ndarray, *, num_layers: int | None, num_experts: int | None,
                 where: str, field_name: str, max_memory: int | None = None) -> dict:
    """Validate an in-memory ``[tokens, layers, top_k]`` array into a token-major trace's
    fields (``Trace(**fields)``)."""
    label = f"{where}: array {field_name!r}"
    member = ArrayMember(field_name, label, tuple(dense.shape), dense.dtype, False, lambda: dense)
    if dense.dtype.hasobject or member.dtype.kind not in "iu":
        raise TraceError(f"{label}: expected an integer array of expert ids, got dtype "
                         f"{dense.dtype}")
    check_member(member)
    return assemble_dense([member], where, optional_positive_int(num_layers, "num_layers"),
                           optional_positive_int(num_experts, "num_experts"),
                           resolve_memory_limit(max_memory), names=False, held=dense.nbytes)


def assemble_dense(members: list[ArrayMember], where: str, declared_layers: int | None,
                    declared_experts: int | None, limit: int, *, names: bool,
                    held: int = 0) -> dict:
    """Validate the members' values and concatenate them, one sequence each, token-major: the
    trace's fields (``Trace(**fields)``)."""
    for member in members:
        if declared_layers is not None and member.shape[1] > declared_layers:
            raise TraceError(f"{member.label}: {member.shape[1]} layers in the array but "
                             f"num_layers={declared_layers} was declared")
    calls = sum(m.shape[0] * m.shape[1] for m in members)
    top_k = max(m.shape[2] for m in members)
    biggest = max(members, key=lambda m: m.nbytes)
    check_memory(held + biggest.nbytes + 2 * trace_bytes(calls, top_k), limit, biggest.label,
                 f"the shape {biggest.shape} ({biggest.dtype}) in its header makes the trace "
                 f"[{calls} calls, top_k {top_k}], which")
    num_layers = declared_layers or max(m.shape[1] for m in members)
    if declared_experts is not None:
        check_geometry(num_layers, declared_experts, limit, where, " (declared)")

    routes = np.full((calls, top_k), -1, dtype=np.int32)
    bound = declared_experts if declared_experts is not None else INT32_MAX
    offsets, row = [], 0
    for member in members:
        values = member.read()
        lo, hi = int(values.min()), int(values.max())
        if lo < -1 or hi >= bound:
            bad = (values < -1) | (values >= bound)
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            text = (f"[-1, {declared_experts}) (num_experts={declared_experts})"
                    if declared_experts is not None else "[-1, 2**31 - 1)")
            note = " (-1 is the only padding value)" if int(values[index]) < -1 else ""
            reason = f"expert {int(values[index])} is outside {text}{note}"
            if declared_experts is None and int(values[index]) >= INT32_MAX:
                reason = id_past_int32("expert", int(values[index]))
            raise TraceError(f"{member.label}[token={index[0]}, layer={index[1]}, "
                             f"k={index[2]}]: {reason}")
        tokens, layers, width = member.shape
        routes[row:row + tokens * layers, :width] = values.reshape(tokens * layers, width)
        offsets.append(row)
        row += tokens * layers
        del values

    def locate(flat_index: int) -> str:
        call, k = divmod(flat_index, top_k)
        number = int(np.searchsorted(offsets, call, side="right")) - 1
        member = members[number]
        token, layer = divmod(call - offsets[number], member.shape[1])
        return f"{member.label}[token={token}, layer={layer}, k={k}]"

    max_expert = int(routes.max())
    if declared_experts is None:
        if max_expert < 0:
            raise TraceError(f"{members[0].label}: every route is padding (-1), so num_experts "
                             f"cannot be inferred; pass num_experts=")
        max_where = locate(int(np.argmax(routes == max_expert)))
        if max_expert >= OUTLIER_FLOOR:
            check_outlier("expert", max_expert, next_largest(routes, max_expert), max_where)
        check_geometry(num_layers, max_expert + 1, limit, max_where, "")
    sequence = np.repeat(np.arange(len(members), dtype=np.int32),
                         [m.shape[0] * m.shape[1] for m in members])
    layer_column = np.concatenate([np.tile(np.arange(m.shape[1], dtype=np.int32), m.shape[0])
                                   for m in members])
    token_column = np.concatenate([np.repeat(np.arange(m.shape[0], dtype=np.int64), m.shape[1])
                                   for m in members])
    return dict(routes=routes, layers=layer_column, num_layers=num_layers,
                num_experts=declared_experts if declared_experts is not None else max_expert + 1,
                token_idx=token_column, sequence=sequence,
                sequence_names=tuple(m.name for m in members) if names else (None,),
                source=where)
