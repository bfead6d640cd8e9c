"""Host-side views of a cache: counters and routing-skew reports, and the describe/diff tables.

Everything here reads a state back to the host (NumPy) and formats it; nothing here is jittable
except the small state edits of :mod:`~pallas_cache.host.reports` that the cache API re-exports.
"""
