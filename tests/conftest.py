"""Shared test configuration.

Hypothesis profiles: ``ci`` (the default) keeps the whole suite within a few minutes on two
cores; ``deep`` runs many more sequences. Pick one with ``PALLAS_CACHE_PROFILE=deep``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "deep",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("PALLAS_CACHE_PROFILE", "ci"))
