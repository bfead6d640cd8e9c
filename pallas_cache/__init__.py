"""pallas_cache: the GPU expert slot cache of offloaded MoE inference, as pure JAX functions.

This namespace is the cache API (``init``, ``ensure``, ``ensure_hybrid``, ...); the report and
view types are in :mod:`pallas_cache.host`, the dense MoE references and the tools for property
tests in :mod:`pallas_cache.testing`
and the offline sizing tool in :mod:`pallas_cache.sizing` (docs/semantics.md is the contract).

The names load on first use (PEP 562): ``import pallas_cache`` imports neither JAX nor NumPy,
so ``pallas-cache --help`` answers before the seconds-long JAX import; the first public name
read from this namespace imports them all at once.
"""

import importlib as _importlib

__all__ = [
    "BACKENDS",
    "ERR_CACHE_SIZE",
    "ERR_EXPERT_ID",
    "ERR_LAYER",
    "ERR_PREFILL_BUSY",
    "ERR_PREFILL_NOT_BEGUN",
    "ERR_SLOT",
    "SMALL_BANK_FEAT_BYTES",
    "Admission",
    "CacheError",
    "CacheState",
    "CopyPlan",
    "EnsurePlan",
    "Eviction",
    "FetchOrder",
    "FetchPolicy",
    "ForgetPlan",
    "MaterializePlan",
    "PrefillDoesNotFit",
    "PrefillPlan",
    "RebuildRejected",
    "apply_copy_plan",
    "begin_prefill",
    "check",
    "checked",
    "cpu_partial",
    "describe",
    "diff",
    "ensure",
    "ensure_hybrid",
    "forget_slot",
    "init",
    "layer_stats",
    "materialize_layer",
    "moe_hybrid",
    "per_layer_stats",
    "prefetch_prefill_layer",
    "prefill_overlap_fits",
    "put_host_bank",
    "rebuild",
    "release_prefill_layer",
    "reset",
    "reset_routing",
    "reset_stats",
    "resize",
    "routing_histogram",
    "routing_skew",
    "set_collect_routing",
    "stack_states",
    "stats",
    "take_state",
]

# The one place the version is written: pyproject.toml reads it (dynamic version, setuptools'
# attr:), so the installed metadata (importlib.metadata.version("pallas-cache")) says the same.
__version__ = "0.1.0"



def _load() -> None:
    """Bind every name of :data:`__all__` here (what this module imported eagerly before)."""
    from pallas_cache.batch import stack_states, take_state
    from pallas_cache.errors import (
        ERR_CACHE_SIZE,
        ERR_EXPERT_ID,
        ERR_LAYER,
        ERR_PREFILL_BUSY,
        ERR_PREFILL_NOT_BEGUN,
        ERR_SLOT,
        CacheError,
        check,
        checked,
    )
    from pallas_cache.counters import (
        reset_routing,
        reset_stats,
        routing_histogram,
        set_collect_routing,
    )
    from pallas_cache.evictions import Eviction
    from pallas_cache.host.reports import layer_stats, per_layer_stats, routing_skew, stats
    from pallas_cache.host.views import describe, diff
    from pallas_cache.kernels.dispatch import BACKENDS
    from pallas_cache.hybrid import cpu_partial, moe_hybrid
    from pallas_cache.moe import apply_copy_plan, put_host_bank
    from pallas_cache.ops import (
        CopyPlan,
        EnsurePlan,
        ForgetPlan,
        MaterializePlan,
        ensure,
        ensure_hybrid,
        forget_slot,
        materialize_layer,
    )
    from pallas_cache.policy import Admission, FetchOrder, FetchPolicy
    from pallas_cache.prefill import (
        SMALL_BANK_FEAT_BYTES,
        PrefillDoesNotFit,
        PrefillPlan,
        begin_prefill,
        prefetch_prefill_layer,
        prefill_overlap_fits,
        release_prefill_layer,
    )
    from pallas_cache.state import (
        CacheState,
        RebuildRejected,
        init,
        rebuild,
        reset,
        resize,
    )
    globals().update({name: value for name, value in locals().items() if name in __all__})


def __getattr__(name: str):  # PEP 562
    if name in __all__:
        _load()
        return globals()[name]
    if name.isidentifier():  # a submodule, imported on first use (once bound eagerly)
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    _load()
    return sorted(globals())
