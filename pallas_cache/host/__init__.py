"""Host-side views of a cache: counters and routing-skew reports, and the describe/diff tables.

Everything here reads a state back to the host (NumPy) and formats it; nothing here is
jittable (the counters' state edits are in :mod:`pallas_cache.counters`).
"""
