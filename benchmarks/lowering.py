"""What a call lowers to, counted without a GPU: the one StableHLO op counter of the benchmarks
(the counting rule of tests/test_kernels.py, docs/semantics.md §7).

Minimal on branch i49 (issue #49): only the counter, moved here from benchmarks/step_ops.py so
that benchmarks/gpu_check.py and step_ops.py count with one function. The lead's version
(issue #43) adds ``abstract_gpu()``; it replaces this file when it lands.
"""

from __future__ import annotations

import re

#: StableHLO ops that cost nothing (or, ``custom_call``, are counted apart as Pallas calls).
UNCOUNTED = {"constant", "reshape", "bitcast_convert", "return", "custom_call", "tuple",
             "get_tuple_element", "optimization_barrier"}
PALLAS_CALL = "custom_call @__gpu$xla.gpu.triton"


def count_ops(text: str) -> tuple[int, int]:
    """``(Pallas calls, other non-free StableHLO ops)`` of a lowered module's text. An
    attribute such as ``#stablehlo.output_operand_alias<...>`` names no operation."""
    ops = [op for op in re.findall(r"(?<![#\w])stablehlo\.([a-z_0-9]+)", text)
           if op not in UNCOUNTED]
    return text.count(PALLAS_CALL), len(ops)
