"""pallas_cache: the GPU expert slot cache of offloaded MoE inference, as pure JAX functions.

Expert weights live in host RAM; a pool of ``S`` device slots holds the experts in use, shared by
all layers (global LRU). Each MoE layer call asks the cache which routed experts are resident,
which must be copied in (and where, evicting whom), and -- in the hybrid mode -- which misses the
CPU computes instead. The cache computes that metadata only; the helpers that apply a plan to
weights (``apply_copy_plan``, and ``moe_hybrid``, whose ``cpu_partial`` runs the plan's CPU
experts on the host CPU) are in :mod:`pallas_cache.moe` and :mod:`pallas_cache.hybrid`.

The state is an immutable pytree and every operation a pure function, so a whole decode step is
one compiled program::

    import pallas_cache as pc
    state = pc.init(num_layers=8, num_experts=16, cache_size=64)
    state, plan = pc.ensure_hybrid(state, layer, expert_ids, pc.FetchPolicy.fraction(0.4))

This namespace is the cache API. The report and view types live in :mod:`pallas_cache.host`, the
kernel entry points in :mod:`pallas_cache.kernels.dispatch`, the dense MoE references in
:mod:`pallas_cache.testing`, and the offline sizing tool in :mod:`pallas_cache.sizing`. See
docs/semantics.md for the contract and docs/design.md for the reasons behind it.
"""

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
from pallas_cache.evictions import Eviction
from pallas_cache.host.reports import (
    layer_stats,
    per_layer_stats,
    reset_routing,
    reset_stats,
    routing_histogram,
    routing_skew,
    set_collect_routing,
    stats,
)
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
    "stats",
]

__version__ = "0.1.0"
