"""The lockstep driver: one operation sequence run on a truth and on candidates, compared after
every step. An operation is ``(kind, args)``; :func:`run` steps any such per-step runs together
(tests/lockstep.py feeds it the adapters' caches, benchmarks/gpu_check.py the steps of its
compiled scans). Needs only NumPy."""

from __future__ import annotations

import numpy as np


def describe(kind, args) -> str:
    """``kind(name=value, ...)`` with arrays as lists, for failure messages."""
    shown = ", ".join(f"{k}={v.tolist() if isinstance(v, np.ndarray) else v}"
                      for k, v in args.items())
    return f"{kind}({shown})"


def run(ops, truth, candidates, compare):
    """Step ``truth`` and every candidate (``{name: per-step results}``, each an iterable with one
    item per op, e.g. :func:`steps`) through ``ops`` together; after every op,
    ``compare(context, op, expected, got)`` checks each candidate's result against the truth's
    and raises ``AssertionError`` naming ``context`` (the step, the op, the candidate) on the
    first difference. Returns the number of steps run."""
    truth = iter(truth)
    runs = {name: iter(results) for name, results in candidates.items()}
    index = -1
    for index, (kind, args) in enumerate(ops):
        expected = next(truth)
        for name, results in runs.items():
            compare(f"op {index} {describe(kind, args)} on {name}", (kind, args), expected,
                    next(results))
    return index + 1
