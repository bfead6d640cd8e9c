"""Pallas kernels of the cache: victim selection and the seed-000 promotion decision (docs/semantics.md §7)."""

from pallas_cache.kernels.promotion import promotion
from pallas_cache.kernels.victims import victims

__all__ = ["promotion", "victims"]
