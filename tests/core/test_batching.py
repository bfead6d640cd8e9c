"""Batched decode (continuous batching) as merged calls: the schedule worked out by hand, and
the replay of the merged calls against the NumPy reference fed the same calls."""

import numpy as np
import pytest

from pallas_cache import reference
from pallas_cache.reference import ReferenceCache, ReferencePolicy
from pallas_cache.sizing.batching import batched_trace
from pallas_cache.sizing.sweep import config_grid, replay
from pallas_cache.sizing.traces import Trace

LAYERS, EXPERTS, TOP_K = 3, 6, 2
LENGTHS = [3, 1, 4, 2, 5, 2]  # tokens of the six requests


def six_requests():
    """Six requests of unequal length, one after the other; every token routes every layer."""
    rng = np.random.default_rng(7)
    routes = {(r, t, l): rng.permutation(EXPERTS)[:TOP_K].astype(np.int32)
              for r, length in enumerate(LENGTHS) for t in range(length) for l in range(LAYERS)}
    keys = list(routes)
    trace = Trace(np.stack([routes[k] for k in keys]), np.asarray([k[2] for k in keys], np.int32),
                  LAYERS, EXPERTS, token_idx=np.asarray([k[1] for k in keys], np.int64),
                  sequence=np.asarray([k[0] for k in keys], np.int32),
                  sequence_names=tuple(f"r{r}" for r in range(len(LENGTHS))))
    return trace, routes


# B = 4, worked out by hand: request r joins the first free slot; a request leaves after its
# last token (r1 after step 0, r3 after 1, r0 after 2, r2 and r5 after 3), and the next one
# takes its place at the next step. Each entry: (request, token) in slot order.
SCHEDULE_B4 = [
    [(0, 0), (1, 0), (2, 0), (3, 0)],
    [(0, 1), (4, 0), (2, 1), (3, 1)],
    [(0, 2), (4, 1), (2, 2), (5, 0)],
    [(4, 2), (2, 3), (5, 1)],          # slot 0 free: no request left
    [(4, 3)],
    [(4, 4)],
]
# B = 8 > 6 requests: all start at step 0; step s runs every request longer than s.
SCHEDULE_B8 = [[(r, s) for r, length in enumerate(LENGTHS) if length > s] for s in range(5)]


def merged_calls(routes, schedule, batch):
    """The merged calls of a schedule: per step, per layer, the tokens' routes in slot order,
    -1 padded to batch * TOP_K."""
    calls = []
    for step in schedule:
        for layer in range(LAYERS):
            merged = np.full(batch * TOP_K, -1, np.int32)
            joined = np.concatenate([routes[(r, t, layer)] for r, t in step])
            merged[:len(joined)] = joined
            calls.append((layer, merged))
    return calls


def reference_counts(calls, size, policy_text):
    cache = ReferenceCache(LAYERS, EXPERTS, size)
    kind, _, value = policy_text.partition(":")
    policy = ReferencePolicy.full() if kind == "full" else ReferencePolicy.fraction(float(value))
    cpu, pairs = 0, {}
    for layer, route in calls:
        plan = cache.ensure_hybrid(layer, route, policy, order="recency", admission="none")
        cpu += int(plan.cpu.sum())
        pair = (int(plan.copy.count), len(set(route[np.asarray(plan.cpu)].tolist())))
        pairs[pair] = pairs.get(pair, 0) + 1
    stats = reference.stats(cache)
    return dict(calls=stats.calls, active=stats.active, missing=stats.missing,
                fetched=stats.fetched, cpu_routes=cpu,
                pair_counts=sorted((f, c, n) for (f, c), n in pairs.items()))


@pytest.mark.parametrize("batch,schedule", [(4, SCHEDULE_B4), (8, SCHEDULE_B8)],
                         ids=["B=4", "B=8-more-than-requests"])
def test_merged_calls_follow_continuous_batching_and_replay_as_the_reference(batch, schedule):
    """FAILS if a finished request's slot is not taken by the next request at the next step
    (static batches: waiting for the whole batch), a request's tokens run out of order, a
    merged call is not the tokens' routes side by side (-1 padded), the step or generated-token
    counts are wrong, or the replay of the merged calls counts other than the reference cache
    fed the same calls (distinct experts per merged call, each read once)."""
    trace, routes = six_requests()
    batched = batched_trace(trace, batch)
    expected = merged_calls(routes, schedule, batch)
    assert [int(l) for l in batched.trace.layers] == [layer for layer, _ in expected]
    np.testing.assert_array_equal(batched.trace.routes, np.stack([r for _, r in expected]))
    assert (batched.steps, batched.generated, batched.requests) == (len(schedule), 17, 6)
    assert batched.trace.num_tokens == len(schedule)
    configs = config_grid([6, 12], ["full", "fraction:0.4"], admissions=["none"])
    for config, result in zip(configs, replay(batched.trace, configs, progress=lambda s: None)):
        want = reference_counts(expected, config.cache_size, config.policy)
        got = {key: getattr(result, key) for key in want}
        got["pair_counts"] = sorted(got["pair_counts"])
        assert got == want, config


def test_batch_one_is_the_trace_in_request_order():
    """FAILS if B = 1 changes any call (the merged trace of one request at a time is the trace
    itself when its requests come one after the other)."""
    trace, _ = six_requests()
    one = batched_trace(trace, 1)
    np.testing.assert_array_equal(one.trace.routes, trace.routes)
    np.testing.assert_array_equal(one.trace.layers, trace.layers)
    assert one.steps == one.generated == 17


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_batch_that_is_not_a_positive_integer_is_refused(bad):
    trace, _ = six_requests()
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        batched_trace(trace, bad)
