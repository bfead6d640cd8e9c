"""The lockstep driver: one operation sequence run on a truth and on candidates, compared after
every step.

An operation is ``(kind, args)``; :func:`steps` runs a sequence on a cache handle of
tests/conftest.py, and :func:`run` compares any such per-step runs (benchmarks/gpu_check.py feeds
it the steps of its compiled scans). Needs only NumPy: it runs where hypothesis and chex do not.
"""

from __future__ import annotations

import numpy as np

def build_policy(cache, spec):
    """The adapter's policy for ``spec = (kind, argument)``: fraction, fixed_cap or full."""
    kind, argument = spec
    make = getattr(cache.adapter.Policy, kind)
    return make() if argument is None else make(argument)


def do(cache, kind, args):
    """Run one operation on a cache handle; returns its plan view, None, or the static error it
    raised as a string (``PrefillDoesNotFit``, ``RebuildRejected(requested=.., minimum=..)``)."""
    errors = cache.adapter.errors
    try:
        if kind == "ensure":
            return cache.ensure(args["layer"], args["routes"])
        if kind == "ensure_hybrid":
            return cache.ensure_hybrid(args["layer"], args["routes"],
                                       build_policy(cache, args["policy"]), order=args["order"],
                                       admission=args["admission"])
        if kind in ("materialize_layer", "release_prefill_layer"):
            return getattr(cache, kind)(args["layer"])
        if kind == "prefetch_prefill_layer":
            return cache.prefetch_prefill_layer(args["layer"], args["banks"])
        if kind == "forget_slot":
            return cache.forget_slot(args["slot"])
        if kind == "set_collect_routing":
            return cache.set_collect_routing(args["on"])
        if kind == "resize":
            return cache.resize(args["size"])
        if kind == "rebuild":
            return cache.rebuild(args["size"], **({"capacity": args["capacity"]}
                                                  if "capacity" in args else {}))
        return getattr(cache, kind)()
    except errors.PrefillDoesNotFit:
        return "PrefillDoesNotFit"
    except errors.RebuildRejected as error:
        return f"RebuildRejected(requested={error.requested}, minimum={error.minimum})"


def steps(cache, ops):
    """Run ``ops`` on ``cache`` one at a time, yielding ``(outcome, cache)`` after each."""
    for kind, args in ops:
        yield do(cache, kind, args), cache


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
