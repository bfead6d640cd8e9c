"""The Pallas kernel of the cache: one whole ensure / ensure_hybrid call fused (docs/semantics.md §7).

:mod:`~pallas_cache.kernels.step` holds the kernel, its named refs and the ``pallas_call``,
:mod:`~pallas_cache.kernels.phases` the phases it calls, named as the XLA step's,
:mod:`~pallas_cache.kernels.search` the victim searches and the clock rebase,
:mod:`~pallas_cache.kernels.ring` the token ring's part of it (ROUTE_KNN, ROUTE_LFU),
:mod:`~pallas_cache.kernels.common` its launch parameters and vector helpers,
:mod:`~pallas_cache.kernels.dispatch` the ``backend=`` switch. The package binds no names of its own."""

import warnings as _warnings

# JAX >= 0.11 warns at every Triton lowering that the Pallas Triton backend is deprecated; the
# lowering runs inside the user's jit, once per compile, so an unfiltered warning reaches users
# of the default GPU path on every compile. The plan (the XLA step as the fallback, a Mosaic GPU
# port) is in docs/backends.md; an accelerated deprecation is handled by dispatch, not hidden.
_warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                         category=DeprecationWarning)
del _warnings
