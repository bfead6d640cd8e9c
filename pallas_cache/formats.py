"""The weight formats of the library's expert banks and their bytes (docs/semantics.md §5.13).

One place for what an expert of each format stores, read by :mod:`pallas_cache.experts` (which
builds and reads the banks) and by the sizing model (:mod:`pallas_cache.sizing.models`, whose
``:int8`` / ``:int4`` sizes are these). Imports neither JAX nor NumPy.

Every matrix of an expert is stored as ``d_expert`` rows of ``d_model`` weights:

- ``fp32``: float32 weights.
- ``bf16``: bfloat16 weights.
- ``int8``: int8 weights and one float32 scale per output channel of each matrix (``d_expert``
  for the matrices that read the token, ``d_model`` for the one that writes the output).
- ``int4``: signed 4-bit weights packed two per byte along the row (the even weight in the low
  nibble), and one float32 scale per :data:`INT4_GROUP` consecutive weights of a row.
"""

from __future__ import annotations

__all__ = ["ALIASES", "FORMATS", "INT4_GROUP", "SCALE_BYTES", "bytes_per_expert",
           "canonical_format", "int4_groups"]

#: The formats the library reads, in the spellings of the sizing model's presets.
FORMATS = ("fp32", "bf16", "int8", "int4")
#: Other spellings of the same formats (JAX's dtype names).
ALIASES = {"float32": "fp32", "bfloat16": "bf16"}
#: Weights of one row that share an int4 scale.
INT4_GROUP = 128
#: Bytes of one scale (float32).
SCALE_BYTES = 4
#: Matrices per expert of each kind: SwiGLU ``w1, w3, w2``; the plain MLP ``w1, w2``.
MATRICES = {"swiglu": 3, "mlp": 2}


def canonical_format(dtype: str) -> str:
    """``dtype`` in :data:`FORMATS`' spelling (``"bfloat16"`` -> ``"bf16"``); raises
    ``ValueError`` naming the formats for another."""
    name = ALIASES.get(str(dtype), str(dtype))
    if name not in FORMATS:
        raise ValueError(f"no expert function reads dtype {dtype!r}: expected one of "
                         f"{', '.join(FORMATS)}")
    return name


def bytes_per_expert(d_model: int, d_expert: int, dtype: str, *, kind: str = "swiglu",
                     group: int = INT4_GROUP) -> int:
    """Bytes one expert of ``kind`` (``"swiglu"``: 3 matrices; ``"mlp"``: 2) of ``d_model x
    d_expert`` matrices occupies in a bank of format ``dtype``, scales included: what
    :func:`pallas_cache.experts.make_bank` stores per expert row.

    ``int8``: ``m * d_model * d_expert`` weight bytes, plus a 4-byte scale per output channel
    (``(m - 1) * d_expert + d_model``). ``int4``: half a byte per weight plus a 4-byte scale per
    ``group`` weights of each of the ``m * d_expert`` rows (:func:`int4_groups`).
    """
    if kind not in MATRICES:
        raise ValueError(f"unknown expert kind {kind!r}: expected one of {', '.join(MATRICES)}")
    dtype = canonical_format(dtype)
    d_model, d_expert, group = int(d_model), int(d_expert), int(group)
    matrices = MATRICES[kind]
    weights = matrices * d_model * d_expert
    if dtype == "fp32":
        return 4 * weights
    if dtype == "bf16":
        return 2 * weights
    if dtype == "int8":
        return weights + SCALE_BYTES * ((matrices - 1) * d_expert + d_model)
    return weights // 2 + SCALE_BYTES * matrices * d_expert * int4_groups(d_model, group)


def int4_groups(d_model: int, group: int = INT4_GROUP) -> int:
    """int4 scales per row of ``d_model`` weights: one per ``group``, or one for the whole row
    where ``group`` does not divide it."""
    return d_model // group if d_model % group == 0 else 1
