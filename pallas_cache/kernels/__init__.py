"""Pallas kernels of the cache: victim selection and the seed-000 promotion decision (docs/semantics.md §7).

:mod:`~pallas_cache.kernels.victims` and :mod:`~pallas_cache.kernels.promotion` hold the kernels
(each beside its ``*_reference``), :mod:`~pallas_cache.kernels.common` their shared pieces, and
:mod:`~pallas_cache.kernels.dispatch` the ``backend=`` switch with the XLA twins that the ops call.
The package binds no names of its own, so each submodule stays reachable under its name.
"""
