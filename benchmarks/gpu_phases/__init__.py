"""The phases of benchmarks/gpu_check.py, one module each, in their default run order: the
equality checks first and at small sizes, then the several-devices path, the LRU miss sweep
against upstream, the copy path, and last the cost of each eviction at four geometries (the
most rows, so a run that overruns its estimates loses those first). Each
module has ``NAME``, ``plan(args) -> [(row, estimated seconds on the GPU)]``, ``run(ctx, row)
-> result`` (``result["status"]``: ``match``, ``MISMATCH``, ``FAIL``) and ``markdown(args,
[(row, result)]) -> lines``; optionally ``smoke_rows(rows)``, the rows of a ``--smoke`` run
(default the first)."""

from . import copy, equality, geometries, mesh, sweep

PHASES = {module.NAME: module for module in (equality, mesh, sweep, copy, geometries)}
