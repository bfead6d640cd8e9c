"""The NumPy oracle of the expert slot cache: docs/semantics.md §3-§6 and §5.12, written to be read.

This is the imperative twin of ``pallas_cache``: one method per operation, int64 arrays, plain
loops, and each rule stated once, in a comment next to the line that implements it. It uses no
JAX. The operations are split along the JAX modules -- :mod:`.state` (fields, cold starts, the
clock tick), :mod:`.ops` (decode), :mod:`.prefill`, :mod:`.reports` -- and this module
assembles them into :class:`ReferenceCache`. The property tests drive both implementations with the same operations and compare every state field
and every plan field after every step, so where the reference and the JAX code disagree, one of
them is wrong and docs/semantics.md says which.

Why the rules are what they are, in one place:

- **One id space, one pool.** Expert ``e`` of layer ``l`` is the flat id ``l * E + e``, and all
  layers compete for the same ``S`` slots: routing is not uniform across layers, and a global LRU
  puts the residency where the traffic is.
- **Victims by ``(usage, slot)`` ascending; a slot touched this step is never a victim.** The
  tie-break is what lets a GPU kernel and this reference pick the same slot. The exclusion is what
  keeps a step from evicting an expert it is about to read.
- **Duplicate routes collapse.** Two tokens routed to one expert are one miss, one copy, one slot.
- **Every route is assigned exactly once** -- to a slot or to the CPU -- so the caller can simply
  add the GPU and CPU partial results.
- **Value errors change nothing.** A bad id, layer or slot comes back as an error bit with the
  cache exactly as it was (not even the clock moves), so a server can drop one bad request and
  keep serving. The reasons behind the choices are in ``docs/design.md``.
"""

from __future__ import annotations

from .errors import (  # noqa: F401  (re-exported: the reference's public names)
    ERR_CACHE_SIZE,
    ERR_EXPERT_ID,
    ERR_LAYER,
    ERR_PREFILL_BUSY,
    ERR_PREFILL_NOT_BEGUN,
    ERR_SLOT,
)
from .ops import (  # noqa: F401
    ADMISSIONS,
    ORDERS,
    CopyPlan,
    DecodeOps,
    EnsurePlan,
    ForgetPlan,
    MaterializePlan,
)
from .prefill import (  # noqa: F401
    SMALL_BANK_FEAT_BYTES,
    HostTransfers,
    MissRuns,
    PrefillDoesNotFit,
    PrefillGather,
    PrefillOps,
    PrefillPlan,
)
from .reports import COVERAGE_FRACTION, LayerSkew, ReferenceStats, Reports, SkewReport  # noqa: F401
from .state import (  # noqa: F401
    DEFAULT_REBASE_THRESHOLD,
    FORGOTTEN,
    RebuildRejected,
    ResizePlan,
    ReferenceState,
)


class ReferenceCache(DecodeOps, PrefillOps, Reports, ReferenceState):
    """The expert slot cache as a mutable object over int64 NumPy arrays: every operation of
    docs/semantics.md as a method. See :class:`~pallas_cache.reference.state.ReferenceState`
    for the fields."""
