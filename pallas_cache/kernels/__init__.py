"""The Pallas kernel of the cache: one whole ensure / ensure_hybrid call fused (docs/semantics.md §7).

:mod:`~pallas_cache.kernels.step` holds the kernel and its named refs,
:mod:`~pallas_cache.kernels.ring` the token ring's part of it (ROUTE_KNN, ROUTE_LFU),
:mod:`~pallas_cache.kernels.common` its launch parameters and vector helpers,
:mod:`~pallas_cache.kernels.dispatch` the ``backend=`` switch. The package binds no names of its own."""
