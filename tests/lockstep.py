"""The lockstep tests' operations: :func:`steps` runs an operation sequence ``(kind, args)`` on a
:class:`~conftest.Cache` of any adapter; :func:`run` (:mod:`pallas_cache.reference.lockstep`)
compares such per-step runs."""

from __future__ import annotations

from pallas_cache.reference.lockstep import describe, run  # noqa: F401


def build_policy(cache, spec):
    """The adapter's policy for ``spec = (kind, argument)``: fraction, fixed_cap or full."""
    kind, argument = spec
    make = getattr(cache.adapter.Policy, kind)
    return make() if argument is None else make(argument)


def do(cache, kind, args):
    """Run one operation on a cache handle; returns its plan, None, or the static error it
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
