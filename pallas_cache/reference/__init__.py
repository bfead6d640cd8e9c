"""NumPy reference of pallas-cache: the oracle the JAX implementation is tested against.

Imperative, int64, no JAX. :class:`ReferenceCache` implements every operation of
docs/semantics.md as a method over a state whose fields have the library's ``CacheState`` names
and nesting (the parts ``residency``, ``clock``, ``routing``, ``stats``, ``prefill``,
``settings``, ``eviction``, ``eviction_state``); the functions of
:mod:`.functions` are the same operations with the library's signatures
(``ensure(state, layer, expert_ids) -> (state, plan)``). ``ReferencePolicy`` is the fetch policy
and its balanced split; :mod:`.evictions` the eviction policies. The plans have the JAX plans'
type names, field names and nesting. The jittable library never imports this package.
"""

from . import checks, evictions  # noqa: F401
from .cache import (  # noqa: F401
    ERR_CACHE_SIZE,
    ERR_EXPERT_ID,
    ERR_LAYER,
    ERR_PREFILL_BUSY,
    ERR_PREFILL_NOT_BEGUN,
    ERR_SLOT,
    FORGOTTEN,
    SMALL_BANK_FEAT_BYTES,
    CopyPlan,
    EnsurePlan,
    ForgetPlan,
    HostTransfers,
    MaterializePlan,
    MissRuns,
    PrefillDoesNotFit,
    PrefillGather,
    PrefillPlan,
    RebuildRejected,
    ReferenceCache,
    ReferenceStats,
    ResizePlan,
)
from .evictions import EvictionPolicy, PairLfuState, TokenRingState  # noqa: F401
from .functions import (  # noqa: F401
    begin_prefill,
    copy_state,
    ensure,
    ensure_hybrid,
    forget_slot,
    init,
    layer_stats,
    materialize_layer,
    per_layer_stats,
    prefetch_prefill_layer,
    prefill_overlap_fits,
    rebuild,
    release_prefill_layer,
    reset,
    reset_routing,
    reset_stats,
    resize,
    routing_histogram,
    routing_skew,
    set_collect_routing,
    start_token,
    stats,
)
from .policy import ReferencePolicy  # noqa: F401
