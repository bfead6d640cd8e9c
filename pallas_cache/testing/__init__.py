"""Testing code built on the cache: dense MoE references, exact state and plan comparisons, the
invariants every plan holds, and cache operations as plain data.

- :func:`moe_dense`, :func:`moe_combine`: the dense MoE oracle and a plan's hybrid output
  (docs/semantics.md §5.13).
- :func:`assert_states_equal`, :func:`assert_plans_equal`: exact whole-tree equality, the message
  naming the first differing field and index.
- :func:`assert_lockstep`: an operation sequence on the NumPy reference and on the library,
  whole plans and states compared after every step (:func:`record_difference` compares a
  reference record with a library one).
- :func:`check_plan`, :func:`check_state`: the invariants of docs/semantics.md §3-§5 on one
  ``ensure`` / ``ensure_hybrid`` call of your own loop, without the reference.
- :class:`Geometry`, :class:`PolicySpec` and the operation records (:class:`Ensure`, ...), run by
  :func:`run_operation`.
- Hypothesis strategies in :mod:`pallas_cache.testing.strategies` (the ``testing`` extra; the
  only module that imports hypothesis). docs/testing.md has a whole property test.

The names load on first use (PEP 562), each from its module: ``import
pallas_cache.testing.lockstep`` imports no JAX (NumPy only, as the reference), and the first
read of a name imports what that name needs.
"""

import importlib as _importlib

__all__ = [
    "BeginPrefill",
    "Ensure",
    "EnsureHybrid",
    "Forget",
    "Geometry",
    "Materialize",
    "Operation",
    "PolicySpec",
    "PrefetchPrefill",
    "ReleasePrefill",
    "Rebuild",
    "Reset",
    "ResetRouting",
    "ResetStats",
    "Resize",
    "SetCollectRouting",
    "StartToken",
    "assert_lockstep",
    "assert_plans_equal",
    "assert_states_equal",
    "check_plan",
    "check_state",
    "moe_combine",
    "moe_dense",
    "record_difference",
    "run_operation",
    "run_operations",
]

#: Where each public name is defined (a module of this package).
_WHERE = {
    **dict.fromkeys(("assert_plans_equal", "assert_states_equal"), "assertions"),
    **dict.fromkeys(("moe_combine", "moe_dense"), "dense"),
    **dict.fromkeys(("check_plan", "check_state"), "invariants"),
    **dict.fromkeys(("assert_lockstep", "record_difference"), "lockstep"),
    **dict.fromkeys(("BeginPrefill", "Ensure", "EnsureHybrid", "Forget", "Geometry", "Materialize",
                     "Operation", "PolicySpec", "PrefetchPrefill", "Rebuild", "ReleasePrefill",
                     "Reset", "ResetRouting", "ResetStats", "Resize", "SetCollectRouting",
                     "StartToken", "run_operation", "run_operations"), "operations"),
}


def __getattr__(name: str):  # PEP 562
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
