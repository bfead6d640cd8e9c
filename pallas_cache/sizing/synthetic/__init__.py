"""Seeded synthetic routing traces: two generator families and their named presets."""

from pallas_cache.sizing.synthetic.presets import PRESETS, checked_params, synthetic_trace
from pallas_cache.sizing.synthetic.realistic import RealisticParams, realistic_token_ids
from pallas_cache.sizing.synthetic.zipf_reuse import (DEFAULT_PRESET_TOKENS, SyntheticParams,
                                                      layer_exponents)

__all__ = [
    "SyntheticParams",
    "RealisticParams",
    "PRESETS",
    "DEFAULT_PRESET_TOKENS",
    "synthetic_trace",
    "checked_params",
    "layer_exponents",
    "realistic_token_ids",
]
