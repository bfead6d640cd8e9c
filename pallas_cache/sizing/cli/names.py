"""The names ``pallas-cache``'s parser offers as choices, without JAX or NumPy: the parser (and
so ``--help``, ``--version`` and every refused command line) answers before the 2-9 s JAX import,
which starts only when work does. A test checks each tuple equal to what it names: the
``FetchOrder``/``Admission`` enums, the ``Eviction`` registry, the synthetic presets and the
record keys. (The trace formats' registry, :mod:`pallas_cache.sizing.traces.formats`, imports
neither: the parser reads it.)
"""

from __future__ import annotations

__all__ = ["ADMISSIONS", "EVICTIONS", "FIELD_KEYS", "ORDERS", "PRESETS"]

#: ``pallas_cache.FetchOrder`` values: which misses win a capped fetch.
ORDERS = ("recency", "lowest_id")
#: ``pallas_cache.Admission`` values: fetches beyond the split.
ADMISSIONS = ("promote_one", "none", "reuse")
#: ``pallas_cache.Eviction`` values (the eviction registry), in its order.
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
#: ``pallas_cache.sizing.synthetic.PRESETS`` keys, sorted.
PRESETS = ("fine-grained", "fine-grained-realistic", "mixtral-like", "mixtral-realistic")
#: ``pallas_cache.sizing.traces.FIELD_KEYS``: the record keys ``--field`` renames.
FIELD_KEYS = ("layer", "token_idx", "experts", "sequence")
