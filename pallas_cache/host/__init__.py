"""Host-side views of a cache: counters and routing-skew reports, and the describe/diff tables."""
