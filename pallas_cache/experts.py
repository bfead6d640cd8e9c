"""Expert functions and banks for the formats real checkpoints hold: float32, bfloat16, int8
with per-output-channel scales, int4 with group scales (docs/semantics.md §5.13).

:data:`swiglu` (Mixtral, Qwen-MoE, DeepSeek: ``w2 @ (silu(w1 @ x) * (w3 @ x))``) and :data:`mlp`
(``w2 @ gelu(w1 @ x)``) are ``expert_fn``\\ s for :func:`~pallas_cache.cpu_partial`,
:func:`~pallas_cache.moe_hybrid`, ``device_partial`` and ``moe_dense``: called on one expert's
weights and one token they dequantize and multiply, accumulating in float32. Inside
``cpu_partial`` they read the expert where it lies in the bank instead (:meth:`Expert.on_tokens`):
a loop over blocks of rows that converts each block where it is read, so an expert is read once,
never copied out of the bank and never converted whole.

A bank (:func:`make_bank`) is a dict of leaves ``[E, ...]`` or ``[L, E, ...]``; every matrix is
stored as ``d_expert`` rows of ``d_model`` weights (``w1``, ``w3``: PyTorch's ``[out, in]``;
``w2``: PyTorch's transposed), so one block of rows of every matrix serves one block of the
expert's hidden units. Quantized formats add a float32 leaf ``<matrix>_scale`` per matrix,
copied with its rows by :func:`~pallas_cache.apply_copy_plan`. Per expert row:

========  ===========================  ===================================================
format    ``w1`` / ``w3`` / ``w2``         ``<matrix>_scale``
========  ===========================  ===================================================
fp32      float32 ``[F, H]``           none
bf16      uint16 ``[F, H]`` (bfloat16  none
          bits; bfloat16 leaves too)
int8      int8 ``[F, H]``              ``w1``/``w3``: ``[F]``; ``w2``: ``[H]`` (per output)
int4      uint8 ``[F, H / 2]``         ``[F, H / group]`` (each row's groups)
========  ===========================  ===================================================

(``F = d_expert``, ``H = d_model``; int4 weights are signed nibbles, the even weight of each
pair in the low one. bfloat16 leaves give the same results, but XLA:CPU converts any bfloat16
operand whole, the bank included: store the bits, as :func:`make_bank` does.) :func:`~pallas_cache.formats.bytes_per_expert` is each format's size, the
one the sizing model uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_cache.formats import (FORMATS, INT4_GROUP, MATRICES, bytes_per_expert,
                                  canonical_format, int4_groups)

__all__ = ["FORMATS", "INT4_GROUP", "Expert", "bank_format", "bytes_per_expert", "dequantize",
           "filler_bank", "make_bank", "mlp", "pool_like", "random_bank", "silu", "swiglu"]

#: Weights of each matrix one step of :meth:`Expert.on_tokens` reads: 64 rows of 4096
#: (measured on XLA:CPU, benchmarks/cpu_experts.py; fewer weights per step pay the loop's
#: per-op cost more often, more spill the block out of the cache).
CHUNK_WEIGHTS = 64 * 4096

_FORMAT_OF_DTYPE = {np.dtype(np.float32): "fp32", np.dtype(jnp.bfloat16): "bf16",
                    np.dtype(np.uint16): "bf16", np.dtype(np.int8): "int8",
                    np.dtype(np.uint8): "int4"}


def _names(kind: str) -> tuple[str, ...]:
    return ("w1", "w3", "w2") if kind == "swiglu" else ("w1", "w2")


def bank_format(weights: Any, *, kind: str = "swiglu", lead: int = 0) -> str:
    """The format (:data:`FORMATS`) of a bank or of one expert's weights, after checking that
    its leaves agree.

    Args:
      weights: a dict with the matrices of ``kind`` and, quantized, their ``<matrix>_scale``.
      kind: ``"swiglu"`` (``w1``, ``w3``, ``w2``) or ``"mlp"`` (``w1``, ``w2``).
      lead: leading axes before each expert's row (0: one expert; 1: ``[E, ...]``; 2:
        ``[L, E, ...]``).

    Raises:
      ValueError: naming the leaf: a missing or unknown leaf, matrices of different dtypes or
        shapes, a dtype no format stores, scales beside float weights or missing beside
        quantized ones, a scale that is not float32 or of the wrong shape.
    """
    if kind not in MATRICES:
        raise ValueError(f"unknown expert kind {kind!r}: expected one of {', '.join(MATRICES)}")
    if not isinstance(weights, dict):
        raise TypeError(f"an expert bank is a dict of leaves {list(_names(kind))} (and their "
                        f"_scale leaves), got {type(weights).__name__}")
    names = _names(kind)
    scales = {f"{n}_scale" for n in names}
    for name in weights:
        if name not in names and name not in scales:
            raise ValueError(f"leaf {name!r} is not a {kind} leaf: expected {list(names)} and, "
                             f"for int8/int4, {sorted(scales)}")
    for name in names:
        if name not in weights:
            raise ValueError(f"leaf {name!r} is missing from the {kind} bank (leaves: "
                             f"{sorted(weights)})")
    first = weights[names[0]]
    dtype = np.dtype(first.dtype)
    if dtype not in _FORMAT_OF_DTYPE:
        raise ValueError(f"leaf {names[0]!r} has dtype {dtype}: no format stores it (float32, "
                         f"bfloat16 or its uint16 bits, int8, uint8-packed int4)")
    fmt = _FORMAT_OF_DTYPE[dtype]
    shape = tuple(first.shape)
    if len(shape) != lead + 2:
        raise ValueError(f"leaf {names[0]!r} has shape {shape}: expected {lead} leading axes "
                         f"and [rows, width]")
    for name in names[1:]:
        leaf = weights[name]
        if np.dtype(leaf.dtype) != dtype:
            raise ValueError(f"mixed dtypes across leaves: {names[0]!r} is {dtype} but {name!r} "
                             f"is {np.dtype(leaf.dtype)}")
        if tuple(leaf.shape) != shape:
            raise ValueError(f"leaf {name!r} has shape {tuple(leaf.shape)} but {names[0]!r} has "
                             f"{shape}: every matrix is stored as [..., d_expert, d_model]")
    present = sorted(scales & set(weights))
    if fmt in ("fp32", "bf16"):
        if present:
            raise ValueError(f"leaf {present[0]!r}: a scale beside {dtype} weights (the dtype "
                             f"and the scales disagree: scales go with int8 or int4 weights)")
        return fmt
    rows, width = shape[-2:]
    prefix = shape[:-2]
    for name in names:
        scale_name = f"{name}_scale"
        if scale_name not in weights:
            raise ValueError(f"leaf {scale_name!r} is missing: {dtype} weights ({fmt}) need a "
                             f"float32 scale leaf per matrix")
        scale = weights[scale_name]
        if np.dtype(scale.dtype) != np.float32:
            raise ValueError(f"leaf {scale_name!r} has dtype {np.dtype(scale.dtype)}: scales "
                             f"are float32")
        if fmt == "int8":
            out = width if name == names[-1] else rows
            want = prefix + (out,)
            what = "one per output channel"
        else:
            groups = scale.shape[-1] if scale.ndim == len(prefix) + 2 else 0
            group = 2 * width // groups if groups else 0
            if not groups or groups * group != 2 * width or group % 2:
                raise ValueError(f"leaf {scale_name!r} has shape {tuple(scale.shape)}: int4 "
                                 f"scales are [..., {rows}, groups] with groups dividing the "
                                 f"row's {2 * width} weights into groups of an even size")
            want = prefix + (rows, groups)
            what = f"one per {group} weights of a row"
        if tuple(scale.shape) != want:
            raise ValueError(f"leaf {scale_name!r} has shape {tuple(scale.shape)}, expected "
                             f"{want} ({what})")
    if fmt == "int4":
        groups = {weights[f"{n}_scale"].shape[-1] for n in names}
        if len(groups) > 1:
            raise ValueError(f"int4 scale leaves disagree on the group count: {sorted(groups)}")
    return fmt


def _d_model(weights: dict, fmt: str, name: str) -> int:
    return weights[name].shape[-1] * (2 if fmt == "int4" else 1)


def _blocks(fmt: str, q, scale, out_scale: bool):
    """float32 blocks of stored rows ``q [..., r, w]``: ``[(block, part)]`` with ``part`` the
    positions of the row's weights the block holds (``None``: all; int4: even, then odd)."""
    if fmt == "fp32":
        return [(q, None)]
    if fmt == "bf16":
        if q.dtype == jnp.uint16:  # bfloat16 bits: shifting them up makes the float32
            q = lax.bitcast_convert_type(q.astype(jnp.uint32) << 16, jnp.float32)
        return [(q.astype(jnp.float32), None)]
    if fmt == "int8":
        scale = scale[..., None, :] if out_scale else scale[..., None]
        return [(q.astype(jnp.float32) * scale, None)]
    signed = lax.bitcast_convert_type(q, jnp.int8)
    group = 2 * q.shape[-1] // scale.shape[-1]
    per_weight = jnp.repeat(scale, group // 2, axis=-1)  # [..., r, w]: the scale of each pair
    even = ((signed << 4) >> 4).astype(jnp.float32) * per_weight
    odd = (signed >> 4).astype(jnp.float32) * per_weight
    return [(even, slice(0, None, 2)), (odd, slice(1, None, 2))]


def _interleave(parts):
    """``[..., H]`` from the outputs of each block part (int4: even and odd positions)."""
    if len(parts) == 1:
        return parts[0]
    return jnp.stack(parts, axis=-1).reshape(parts[0].shape[:-1] + (-1,))


def dequantize(weights: dict, *, kind: str = "swiglu") -> dict:
    """One expert's (or a bank's) matrices as float32 ``[..., d_expert, d_model]``, scales
    applied: the stored layout, in float32 (what :data:`swiglu` multiplies by)."""
    lead = weights[_names(kind)[0]].ndim - 2
    fmt = bank_format(weights, kind=kind, lead=lead)
    names = _names(kind)
    return {name: _interleave([b for b, _ in _blocks(fmt, weights[name],
                                                      weights.get(f"{name}_scale"),
                                                      name == names[-1])])
            for name in names}


def silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))``: ``jax.nn.silu``'s logistic is lowered on jax
    0.12 with a device-memory constant, which a ``compute_on`` region over a host bank refuses
    ("memory_space of all inputs passed to `add` must be the same")."""
    return x / (1 + jnp.exp(-x))


@dataclasses.dataclass(frozen=True)
class Expert:
    """An expert function of the library's bank formats (module docstring).

    Call it as ``expert_fn(weights, x_row)`` (one expert's weights, one token ``[H]`` ->
    ``[H]`` float32). :func:`~pallas_cache.cpu_partial` calls :meth:`on_tokens` instead, which
    reads the expert in place in the bank.

    Attributes:
      kind: ``"swiglu"`` (``w2 @ (activation(w1 @ x) * (w3 @ x))``) or ``"mlp"``
        (``w2 @ activation(w1 @ x)``).
      activation: the elementwise nonlinearity (:func:`silu`, ``jax.nn.gelu``, ...).
      chunk: rows of each matrix one step of :meth:`on_tokens` reads; None: as many as hold
        :data:`CHUNK_WEIGHTS` weights (at least one).
    """

    kind: str = "swiglu"
    activation: Callable[[jax.Array], jax.Array] = silu
    chunk: int | None = None

    def __call__(self, weights: dict, x: jax.Array) -> jax.Array:
        """``[H]`` float32: this expert (``weights``: one expert's leaves) on the token ``x``."""
        fmt = bank_format(weights, kind=self.kind)
        _check_width(weights, fmt, self.kind, x)
        x = jnp.asarray(x, jnp.float32)
        return self._rows(fmt, lambda name: weights[name],
                          lambda name: weights.get(f"{name}_scale"), x[None])[0]

    def on_tokens(self, bank: dict, index: tuple, tokens: jax.Array) -> jax.Array:
        """``[T, H]`` float32: the expert at ``bank[index]`` (``index``: the int32 scalars of the
        leading axes, ``(expert,)`` or ``(layer, expert)``) on the tokens ``[T, H]``, read in
        place: a loop over blocks of :attr:`chunk` rows of every matrix, each block sliced and
        converted where it is read."""
        fmt = bank_format(bank, kind=self.kind, lead=len(index))
        _check_width(bank, fmt, self.kind, tokens)
        names = _names(self.kind)
        rows = bank[names[0]].shape[-2]
        tokens = jnp.asarray(tokens, jnp.float32)
        chunk = self.chunk if self.chunk is not None else CHUNK_WEIGHTS // tokens.shape[-1]
        size = max(1, min(int(chunk), rows))
        steps, tail = divmod(rows, size)
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)

        def block(start, length):
            def rows_of(name):
                leaf = bank[name]
                begin = index + (start,) + (jnp.int32(0),) * (leaf.ndim - len(index) - 1)
                piece = lax.dynamic_slice(leaf, begin, (1,) * len(index) + (length,)
                                          + leaf.shape[len(index) + 1:])
                return piece.reshape(piece.shape[len(index):])

            def scale_of(name):
                scale = bank.get(f"{name}_scale")
                if scale is None:
                    return None
                if fmt == "int8" and name == names[-1]:  # per output channel: the whole [H]
                    piece = lax.dynamic_slice(scale, index + (jnp.int32(0),),
                                              (1,) * len(index) + scale.shape[-1:])
                    return piece.reshape(scale.shape[-1:])
                return rows_of(f"{name}_scale")
            return rows_of, scale_of

        def step(i, parts):
            rows_of, scale_of = block(i * size, size)
            new = self._hidden_to_out(fmt, rows_of, scale_of, tokens)
            return tuple(p + n for p, n in zip(parts, new))

        rows_of, scale_of = block(jnp.int32(0), size)
        parts = self._hidden_to_out(fmt, rows_of, scale_of, tokens)
        parts = lax.fori_loop(1, steps, step, parts)
        if tail:
            rows_of, scale_of = block(jnp.int32(steps * size), tail)
            parts = tuple(p + n for p, n in zip(
                parts, self._hidden_to_out(fmt, rows_of, scale_of, tokens)))
        return _interleave(list(parts))

    def _hidden_to_out(self, fmt, rows_of, scale_of, tokens):
        """The parts of the output ``[T, H]`` a block of hidden units contributes."""
        names = _names(self.kind)

        def hidden(name):  # [r, T]: the block's hidden units of one input matrix
            blocks = _blocks(fmt, rows_of(name), scale_of(name), False)
            out = None
            for weights, part in blocks:
                x = tokens if part is None else tokens[:, part]
                # rows [r, H] against tokens [T, H] on their minor axes: XLA:CPU's matrix-vector
                # kernel (tokens @ rows.T runs several times slower for one token).
                term = lax.dot_general(weights, x, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
                out = term if out is None else out + term
            return out

        h = self.activation(hidden("w1"))
        if self.kind == "swiglu":
            h = h * hidden("w3")
        return tuple(lax.dot_general(h, weights, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [T, H]
                     for weights, _ in _blocks(fmt, rows_of(names[-1]), scale_of(names[-1]),
                                               True))

    def _rows(self, fmt, rows_of, scale_of, tokens):
        return _interleave(list(self._hidden_to_out(fmt, rows_of, scale_of, tokens)))


def _check_width(weights, fmt, kind, x):
    d_model = _d_model(weights, fmt, _names(kind)[0])
    if x.shape[-1] != d_model:
        raise ValueError(f"the token has {x.shape[-1]} features but leaf 'w1' stores rows of "
                         f"{d_model} weights ({fmt})")


#: Mixtral / Qwen-MoE / DeepSeek's expert, ``w2 @ (silu(w1 @ x) * (w3 @ x))``.
swiglu = Expert("swiglu", silu)
#: The two-matrix MLP, ``w2 @ gelu(w1 @ x)``.
mlp = Expert("mlp", jax.nn.gelu)


def _quantize_int8(matrix: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 weights and float32 scales along ``axis`` (the one each scale covers)."""
    peak = np.max(np.abs(matrix), axis=axis, keepdims=True)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(matrix / scale), -127, 127).astype(np.int8)
    return q, np.squeeze(scale, axis)


def _quantize_int4(matrix: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed int4 weights ``[..., w / 2]`` (uint8) and float32 group scales ``[..., w /
    group]`` of rows ``[..., w]``."""
    grouped = matrix.reshape(matrix.shape[:-1] + (-1, group))
    peak = np.max(np.abs(grouped), axis=-1, keepdims=True)
    scale = np.where(peak > 0, peak / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(grouped / scale), -8, 7).astype(np.int8).reshape(matrix.shape)
    packed = (q[..., 0::2].astype(np.uint8) & 0xF) | ((q[..., 1::2].astype(np.uint8) & 0xF) << 4)
    return packed.astype(np.uint8), scale[..., 0]


def make_bank(weights: dict, dtype: str = "bf16", *, kind: str = "swiglu",
              group: int = INT4_GROUP) -> dict:
    """A bank of format ``dtype`` from float weights, quantized when asked (NumPy, host side).

    Args:
      weights: ``{"w1", "w3", "w2"}`` (``kind="mlp"``: ``{"w1", "w2"}``) in ``x @ W`` layout
        with leading axes ``[E]`` or ``[L, E]``: ``w1``/``w3`` ``[..., H, F]``, ``w2``
        ``[..., F, H]``. Any float dtype.
      dtype: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"`` (``"float32"``, ``"bfloat16"``).
      kind: ``"swiglu"`` or ``"mlp"``.
      group: int4 weights per scale along a row (must divide ``H``, even).

    Returns:
      The bank (module docstring): NumPy leaves ``[..., F, H]`` (int4 ``[..., F, H / 2]``) and,
      quantized, the ``_scale`` leaves; round to nearest, symmetric (int8 ``[-127, 127]``, int4
      ``[-8, 7]``, each scale the absolute peak it covers over 127 or 7). Put it in host memory
      with :func:`~pallas_cache.put_host_bank`.

    Raises:
      ValueError: an unknown ``dtype`` or ``kind``; a missing matrix, or matrices whose shapes do
        not agree; for int4 an odd ``H`` or a ``group`` that does not divide ``H`` or is odd
        (each names the leaf).
    """
    fmt = canonical_format(dtype)
    if kind not in MATRICES:
        raise ValueError(f"unknown expert kind {kind!r}: expected one of {', '.join(MATRICES)}")
    names = _names(kind)
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"leaf {missing[0]!r} is missing: a {kind} bank is made from "
                         f"{list(names)}")
    stored = {}
    for name in names:
        matrix = np.asarray(weights[name], np.float32)
        rows = matrix if name == names[-1] else np.swapaxes(matrix, -1, -2)  # [..., F, H]
        stored[name] = rows
    shape = stored[names[0]].shape
    for name in names[1:]:
        if stored[name].shape != shape:
            raise ValueError(f"leaf {name!r} gives rows {stored[name].shape} but {names[0]!r} "
                             f"gives {shape} (x @ W layout: w1/w3 [..., H, F], w2 [..., F, H])")
    width = shape[-1]
    if fmt == "int4" and (width % 2 or width % int(group) or int(group) % 2):
        raise ValueError(f"leaf {names[0]!r}: int4 packs two weights per byte in groups of "
                         f"{group} along rows of {width} weights; {width} must be a multiple of "
                         f"an even group")
    bank = {}
    for name in names:
        rows = stored[name]
        if fmt == "fp32":
            bank[name] = rows
        elif fmt == "bf16":
            bank[name] = rows.astype(jnp.bfloat16).view(np.uint16)
        elif fmt == "int8":
            bank[name], bank[f"{name}_scale"] = _quantize_int8(
                rows, axis=-2 if name == names[-1] else -1)
        else:
            bank[name], bank[f"{name}_scale"] = _quantize_int4(rows, int(group))
    return bank


def random_bank(seed: int, num_experts: int, d_model: int, d_expert: int, dtype: str = "bf16",
                *, layers: int | None = None, kind: str = "swiglu",
                group: int = INT4_GROUP) -> dict:
    """A bank of ``num_experts`` (``[layers, E]`` with ``layers``) random experts of format
    ``dtype``: normal weights of scale ``1 / sqrt(fan_in)``, made one expert at a time (the
    float32 of one expert is the peak beyond the bank). For tests and benchmarks."""
    rng = np.random.default_rng(seed)
    names = _names(kind)
    lead = (num_experts,) if layers is None else (layers, num_experts)
    pieces = []
    for _ in range(int(np.prod(lead))):
        expert = {n: rng.standard_normal(
            (d_model, d_expert) if n != names[-1] else (d_expert, d_model), np.float32)
            / np.float32(np.sqrt(d_model if n != names[-1] else d_expert)) for n in names}
        pieces.append(make_bank(expert, dtype, kind=kind, group=group))
    return {name: np.stack([p[name] for p in pieces]).reshape(lead + pieces[0][name].shape)
            for name in pieces[0]}


def filler_bank(num_experts: int, d_model: int, d_expert: int, dtype: str = "bf16", *,
                kind: str = "swiglu") -> dict:
    """A bank of ``num_experts`` experts of format ``dtype`` whose weights are one constant
    (about ``1 / d_model``, no denormal), made by JAX with no NumPy array to stage it through:
    for measurements, where the values do not matter to the time."""
    fmt = canonical_format(dtype)
    names = _names(kind)
    width = d_model // 2 if fmt == "int4" else d_model
    value = 1.0 / d_model
    fill = {"fp32": (value, jnp.float32),
            "bf16": (int(np.asarray(value, jnp.bfloat16).view(np.uint16)), jnp.uint16),
            "int8": (1, jnp.int8), "int4": (0x11, jnp.uint8)}[fmt]
    bank = {name: jnp.full((num_experts, d_expert, width), fill[0], fill[1]) for name in names}
    if fmt == "int8":
        bank.update({f"{name}_scale": jnp.full(
            (num_experts, d_model if name == names[-1] else d_expert), value, jnp.float32)
            for name in names})
    if fmt == "int4":
        bank.update({f"{name}_scale": jnp.full(
            (num_experts, d_expert, int4_groups(d_model)), value, jnp.float32)
            for name in names})
    return bank


def pool_like(bank: dict, num_slots: int, *, layer_axis: bool = False) -> dict:
    """A zero device pool of ``num_slots`` rows for ``bank`` (leaves ``[S, ...]``, the bank's row
    shapes and dtypes): the pool :func:`~pallas_cache.apply_copy_plan` fills. ``layer_axis``:
    the bank's leaves are ``[L, E, ...]``."""
    skip = 2 if layer_axis else 1
    return {name: jnp.zeros((int(num_slots),) + tuple(leaf.shape[skip:]), leaf.dtype)
            for name, leaf in bank.items()}
