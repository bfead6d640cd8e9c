"""NumPy reference of pallas-cache: the oracle the JAX implementation is tested against.

Imperative, int64, no JAX. ``ReferenceCache`` implements every operation of docs/semantics.md;
``ReferencePolicy`` the fetch policy and its balanced split. The modules follow the JAX package's
(``state``, ``clock``, ``ops``, ``prefill``, ``reports``, ``policy``, ``errors``) and the plans have
the JAX plans' type names and structure.
"""

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
    ResizePlan,
    ReferenceCache,
    ReferencePlan,
    ReferencePrefillPlan,
    ReferenceStats,
)
from .policy import ReferencePolicy  # noqa: F401
