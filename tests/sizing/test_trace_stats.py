"""Trace statistics on hand-counted traces and against brute-force counts.

A naive statistic fails: counting padding, counting duplicates twice in the reuse rate,
averaging unrouted layers as zeros, NaN entropy for E == 1, pairing calls across sequences or
layers, choosing the neighbour by the current layer itself or breaking ties towards older
tokens, or a per-layer LRU that shares slots across layers.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pallas_cache.sizing.synthetic import synthetic_trace
from pallas_cache.sizing.trace_stats import (complete_sequences, lag_repeat_probability,
                                             neighbour_precision, next_token_precision,
                                             per_layer_lru_hit_rate, trace_statistics)
from pallas_cache.sizing.traces import Trace, load_trace, save_trace


# ---- skew, reuse and working set ------------------------------------------------------------


def test_entropy_and_working_set_hand_counted():
    # Layer 0: experts 0 and 1 twice each -> p = (1/2, 1/2, 0, 0) -> H = ln 2, / ln 4 = 0.5.
    # Layer 1: never routed (padding only) -> absent. Layer 2: all on expert 3 -> 0.0.
    trace = Trace(routes=[[0, 1], [1, 0], [-1, -1], [3, 3], [3, -1]], layers=[0, 0, 1, 2, 2],
                  num_layers=3, num_experts=4)
    stats = trace_statistics(trace)
    assert stats.routed_layers.tolist() == [0, 2]
    assert stats.routes.tolist() == [4, 3]
    assert np.allclose(stats.norm_entropy, [0.5, 0.0])
    assert stats.mean_norm_entropy == pytest.approx(0.25)   # not 1/6: layer 1 is not a zero
    assert stats.working_set.tolist() == [2, 1]
    assert stats.working_set_mean == 1.5 and stats.working_set_max == 2


def test_entropy_of_a_flat_router_is_one_and_of_a_single_expert_layer_zero():
    flat = Trace(routes=[[0, 1], [2, 3]], layers=[0, 0], num_layers=1, num_experts=4)
    assert trace_statistics(flat).norm_entropy.tolist() == [pytest.approx(1.0)]
    single = Trace(routes=[[0], [0]], layers=[0, 0], num_layers=1, num_experts=1)
    assert trace_statistics(single).norm_entropy.tolist() == [0.0]  # not NaN (docs/semantics.md §10)


def test_reuse_rate_hand_counted_with_duplicates_padding_and_sequences():
    # Layer 0, sequence a: {0,1} -> {1,2} (1 of 2 reused) -> {1,1,-1} = {1} (1 of 1) -> {3} (0/1)
    # Layer 1, sequence a: {0} -> {0, 2} (1 of 2).
    # Sequence b, layer 0: its first call has no predecessor (a's calls are another sequence).
    trace = Trace(
        routes=[[0, 1, -1], [0, -1, -1], [1, 2, -1], [0, 2, -1], [1, 1, -1], [3, -1, -1],
                [0, 1, -1]],
        layers=[0, 1, 0, 1, 0, 0, 0], sequence=[0, 0, 0, 0, 0, 0, 1], sequence_names=("a", "b"),
        token_idx=[0, 0, 1, 1, 2, 3, 0], num_layers=2, num_experts=4)
    stats = trace_statistics(trace)
    # Pooled: (1 + 1 + 0 + 1) reused of (2 + 1 + 1 + 2) distinct experts.
    assert stats.mean_reuse_rate == pytest.approx(3 / 6)
    assert stats.reuse_rate.tolist() == [pytest.approx(2 / 4), pytest.approx(1 / 2)]


def test_statistics_of_an_all_padding_trace_is_an_error():
    with pytest.raises(ValueError, match="no non-padding route"):
        trace_statistics(Trace(routes=[[-1]], layers=[0], num_layers=1, num_experts=2))


# ---- lag repeats, neighbour and next-token precision ----------------------------------------


def _lag_trace():
    # Calls: (sequence, layer, routes). Layer 0 of a: {0,1} {1,2} {1} {0,2}; layer 1 of a: {0},
    # padding only, {0,2}; sequence b: layer 0 {0,1}.
    return Trace(
        routes=[[0, 1, -1], [0, -1, -1], [1, 2, -1], [-1, -1, -1], [1, 1, -1], [0, 2, -1],
                [0, 2, -1], [0, 1, -1]],
        layers=[0, 1, 0, 1, 0, 1, 0, 0], sequence=[0, 0, 0, 0, 0, 0, 0, 1],
        sequence_names=("a", "b"), token_idx=[0, 0, 1, 1, 2, 2, 3, 0], num_layers=2,
        num_experts=4)


def test_lag_repeat_probability_hand_counted():
    """FAILS if lag pairs cross sequences or layers, count duplicate or padding routes, or keep
    pairs whose earlier call is all padding."""
    lags = lag_repeat_probability(_lag_trace(), max_lag=4)
    # Lag 1: layer 0: {1,2}|{0,1} 1/2, {1}|{1,2} 1/1, {0,2}|{1} 0/2; layer 1: {}|{0} 0/0,
    # {0,2}|{} skipped (nothing routed before). 2 of 5.
    # Lag 2: layer 0: {1}|{0,1} 1/1, {0,2}|{1,2} 1/2; layer 1: {0,2}|{0} 1/2. 3 of 5.
    # Lag 3: layer 0: {0,2}|{0,1} 1/2. Lag 4: no call has a 4th predecessor.
    assert lags[:3].tolist() == [pytest.approx(2 / 5), pytest.approx(3 / 5), pytest.approx(1 / 2)]
    assert np.isnan(lags[3])
    assert lags[0] == pytest.approx(trace_statistics(_lag_trace()).mean_reuse_rate)


def test_lag_repeat_probability_refuses_a_bad_lag():
    with pytest.raises(ValueError, match="max_lag must be a positive integer, got 0"):
        lag_repeat_probability(_lag_trace(), max_lag=0)


def _neighbour_trace():
    # tokens x layers, top-2 of 4 experts:
    #   token 0: {0,1} {0,1} {0,1}
    #   token 1: {2,3} {2,3} {2,3}
    #   token 2: {0,1} {2,3} {2,3}
    return Trace.from_dense([[[0, 1], [0, 1], [0, 1]],
                             [[2, 3], [2, 3], [2, 3]],
                             [[0, 1], [2, 3], [2, 3]]], num_experts=4)


def test_neighbour_precision_hand_counted():
    """FAILS if the neighbour is chosen using the predicted layer itself, always the previous
    token, ties go to the older token, or layer 0 (no evidence yet) is counted."""
    # Token 1: the only past token is 0; layers 1 and 2 predict {0,1} for {2,3}: 0 of 4.
    # Token 2, layer 1: layer 0 matches token 0 (2) over token 1 (0) -> predicts {0,1}: 0 of 2.
    # Token 2, layer 2: layers 0-1 match both tokens twice -> the most recent, token 1, predicts
    # {2,3}: 2 of 2. Total 2 of 8.
    assert neighbour_precision(_neighbour_trace(), window=128) == pytest.approx(2 / 8)
    # A window of one token: the previous token always: token 2 gets 2 + 2 of 4 -> 4 of 8.
    assert neighbour_precision(_neighbour_trace(), window=1) == pytest.approx(4 / 8)


def test_neighbour_precision_needs_a_window():
    with pytest.raises(ValueError, match="window must be a positive integer, got 0"):
        neighbour_precision(_neighbour_trace(), window=0)


def _next_token_brute(dense, window):
    """next_token_precision written out with Python sets, token by token."""
    matched, predicted = _next_token_pair(dense, window)
    return matched / predicted if predicted else float("nan")


def test_next_token_precision_hand_counted():
    """FAILS if ties go to the older token, the previous token is not a candidate, the neighbour
    itself (not its successor) predicts, or the match uses fewer than all layers of the token."""
    # Two layers, top-1 of 4. Tokens: (0,1) (2,3) (0,3) (0,3).
    # T=1: only j=0 -> its successor (2,3) predicts (0,3): 1 of 2.
    # T=2: j=1 and j=0 both match once (layer 1 / layer 0): the most recent, j=1, whose
    # successor is T=2 itself, (0,3), predicts (0,3): 2 of 2. Total 3 of 4.
    trace = Trace.from_dense([[[0], [1]], [[2], [3]], [[0], [3]], [[0], [3]]], num_experts=4)
    assert next_token_precision(trace) == pytest.approx(3 / 4)
    # A repeated phrase A B C A B C: at T=3 (A) the neighbour is token 0 (A), whose successor B
    # is right; at T=4 (B) token 1, whose successor C is right; T=1, 2 predict wrongly. 4 of 8.
    a, b, c = [[0], [0]], [[1], [1]], [[2], [2]]
    phrase = Trace.from_dense([a, b, c, a, b, c], num_experts=4)
    assert next_token_precision(phrase) == pytest.approx(4 / 8)
    # A window of one token always takes the previous token: no successor repeats here. 0 of 8.
    assert next_token_precision(phrase, window=1) == 0.0


def test_next_token_precision_equals_a_brute_force_count():
    """FAILS if the vectorised blocks, the window edge or duplicate routes are handled otherwise
    than the token-by-token definition."""
    rng = np.random.default_rng(7)
    for _ in range(12):
        tokens, layers, experts = int(rng.integers(3, 40)), int(rng.integers(1, 4)), 70
        dense = rng.integers(0, 5, size=(tokens, layers, 3))      # few ids: ties and duplicates
        dense[:, :, 2] = np.where(rng.random((tokens, layers)) < 0.3, 66, dense[:, :, 2])
        trace = Trace.from_dense(dense, num_experts=experts)       # ids past 64: a second word
        for window in (1, 3, 128):
            assert next_token_precision(trace, window, block=int(rng.integers(1, 8))) == \
                pytest.approx(_next_token_brute(dense, window), abs=0)


def test_next_token_precision_needs_a_window_and_three_tokens():
    with pytest.raises(ValueError, match="window must be a positive integer, got 0"):
        next_token_precision(_neighbour_trace(), window=0)
    assert np.isnan(next_token_precision(Trace.from_dense([[[0]], [[1]]], num_experts=2)))


# ---- traces with several requests and ragged tokens -----------------------------------------


def _ragged_trace(rng, *, sequences, layers, experts, top_k, tokens=(2, 30)):
    """Random JSONL-like trace: sequences of tokens calling layers 0..L-1 in order, the last 1-3
    tokens of each stopping after a random number of layers, requests interleaved by token."""
    calls = []
    for seq in range(sequences):
        count = int(rng.integers(*tokens))
        short = int(rng.integers(1, 4))
        for token in range(count):
            reached = layers if token < count - short else int(rng.integers(1, layers + 1))
            for layer in range(reached):
                route = rng.integers(-1, min(experts, 5), size=top_k)  # few ids: ties, repeats
                calls.append((token, seq, layer, route))
    calls.sort(key=lambda c: (c[0], c[1], c[2]))  # interleaved: token-major across requests
    return Trace(routes=np.array([c[3] for c in calls]), layers=[c[2] for c in calls],
                 sequence=[c[1] for c in calls], token_idx=[c[0] for c in calls],
                 sequence_names=tuple(f"req{seq}" for seq in range(sequences)),
                 num_layers=layers, num_experts=experts)


def _complete_brute(trace):
    """Per sequence, the complete tokens' [L, K] routes in token order, by dictionaries."""
    calls = {}
    for seq, token, layer, route in zip(trace.sequence.tolist(), trace.token_idx.tolist(),
                                        trace.layers.tolist(), trace.routes.tolist()):
        calls.setdefault(seq, {}).setdefault(token, []).append((layer, route))
    out = []
    for seq in sorted(calls):
        rows = [[route for _, route in made] for _, made in sorted(calls[seq].items())
                if [layer for layer, _ in made] == list(range(trace.num_layers))]
        if rows:
            out.append(np.array(rows))
    return out


def _neighbour_brute(dense, window):
    """neighbour_precision of one dense sequence with Python sets: (matched, predicted)."""
    routes = [[{int(e) for e in call if e >= 0} for call in token] for token in dense]
    matched = predicted = 0
    for now in range(1, len(routes)):
        for layer in range(1, len(routes[now])):
            best, best_match = None, -1
            for j in range(now - 1, max(0, now - window) - 1, -1):  # most recent first
                match = sum(len(a & b) for a, b in zip(routes[now][:layer], routes[j][:layer]))
                if match > best_match:
                    best, best_match = j, match
            matched += len(routes[best][layer] & routes[now][layer])
            predicted += len(routes[best][layer])
    return matched, predicted


def _multi_request_jsonl(tmp_path):
    # Two requests, 2 layers, top-1 of 4; each request's last token stops after layer 0.
    #   r0: A B C A B C + (A, -)    r1: C A B + (B, -)
    # with A = (0, 0), B = (1, 1), C = (2, 2), written interleaved by token as a server logs them.
    a, b, c = [[0], [0]], [[1], [1]], [[2], [2]]
    requests = {"r0": [a, b, c, a, b, c, [[0]]], "r1": [c, a, b, [[1]]]}
    calls = [(token, name, layer, route) for name, tokens in requests.items()
             for token, layers in enumerate(tokens) for layer, route in enumerate(layers)]
    calls.sort(key=lambda call: call[:3])
    names = tuple(requests)
    trace = Trace(routes=[call[3] for call in calls], layers=[call[2] for call in calls],
                  sequence=[names.index(call[1]) for call in calls],
                  token_idx=[call[0] for call in calls], sequence_names=names, num_layers=2,
                  num_experts=4)
    path = tmp_path / "requests.jsonl"
    save_trace(trace, path)
    return load_trace(path)


def test_complete_sequences_drops_the_tokens_that_miss_layers(tmp_path):
    """FAILS if requests are run together, their calls left interleaved, or a token that stops
    before the last layer is kept (padded) instead of dropped."""
    trace = _multi_request_jsonl(tmp_path)
    r0, r1 = complete_sequences(trace)
    a, b, c = [[0], [0]], [[1], [1]], [[2], [2]]
    assert r0.tolist() == [a, b, c, a, b, c] and r1.tolist() == [c, a, b]
    dense = synthetic_trace("mixtral-realistic", num_tokens=40, seed=1)
    (only,) = complete_sequences(dense)
    assert np.array_equal(only, dense.to_dense())


def test_precisions_pool_the_requests_of_a_jsonl_trace_by_calls(tmp_path):
    """FAILS if the requests are concatenated (a neighbour or successor taken across requests),
    the per-request precisions averaged instead of pooled, or the short last tokens counted."""
    trace = _multi_request_jsonl(tmp_path)
    # Next token: r0 alone is the phrase of test_next_token_precision_hand_counted, 4 of 8; r1:
    # at T=1 (A) the only past token C's successor A predicts B: 0 of 2. Pooled: 4 of 10.
    assert next_token_precision(trace) == pytest.approx(4 / 10)
    # Neighbour: r0 (A B C A B C): layer 1 of token t predicted by the best match on layer 0,
    # which is the token 3 back for t >= 3 (right, 1 each: 3 of 5); t = 1, 2 wrong. r1 (C A B):
    # no repeat: 0 of 2. Pooled: 3 of 7.
    assert neighbour_precision(trace) == pytest.approx(3 / 7)


@pytest.mark.parametrize("case", range(6))
def test_precisions_of_ragged_requests_equal_a_brute_force_count(case):
    """FAILS if a sequence's complete tokens are found, ordered or pooled otherwise than the
    per-request, set-by-set definitions (ties, duplicates and padding included)."""
    rng = np.random.default_rng(100 + case)
    layers = int(rng.integers(1, 4))
    trace = _ragged_trace(rng, sequences=int(rng.integers(1, 4)), layers=layers, experts=70,
                          top_k=3)
    brute = _complete_brute(trace)
    assert [d.tolist() for d in complete_sequences(trace)] == [d.tolist() for d in brute]
    for window in (1, 4, 128):
        counts = [_neighbour_brute(d, window) for d in brute]
        matched, predicted = sum(m for m, _ in counts), sum(p for _, p in counts)
        expected = matched / predicted if predicted else None
        got = neighbour_precision(trace, window, block=int(rng.integers(1, 8)))
        assert (np.isnan(got) and expected is None) or got == pytest.approx(expected, abs=0)
        counts = [_next_token_pair(d, window) for d in brute]
        matched, predicted = sum(m for m, _ in counts), sum(p for _, p in counts)
        expected = matched / predicted if predicted else None
        got = next_token_precision(trace, window, block=int(rng.integers(1, 8)))
        assert (np.isnan(got) and expected is None) or got == pytest.approx(expected, abs=0)


def _next_token_pair(dense, window):
    """(matched, predicted) of next_token_precision on one dense sequence, with sets."""
    routes = [[{int(e) for e in call if e >= 0} for call in token] for token in dense]
    matched = predicted = 0
    for now in range(1, len(routes) - 1):
        best, best_match = None, -1
        for j in range(now - 1, max(0, now - window) - 1, -1):
            match = sum(len(a & b) for a, b in zip(routes[now], routes[j]))
            if match > best_match:
                best, best_match = j, match
        matched += sum(len(a & b) for a, b in zip(routes[best + 1], routes[now + 1]))
        predicted += sum(len(a) for a in routes[best + 1])
    return matched, predicted


# ---- per-layer LRU --------------------------------------------------------------------------


def _per_layer_lru_brute(trace, cache_size):
    """Per-layer LRU one call at a time with plain lists, over the calls in call order."""
    per_layer = cache_size // trace.num_layers
    resident = {layer: [] for layer in range(trace.num_layers)}
    hits = active = 0
    for call, (layer, route) in enumerate(trace):
        wanted = sorted({int(e) for e in route if e >= 0})
        held = {e for _, e in resident[int(layer)]}
        hits += sum(e in held for e in wanted)
        active += len(wanted)
        entries = [(use, e) for use, e in resident[int(layer)] if e not in wanted]
        entries += [(call, e) for e in wanted]
        entries.sort()                                 # oldest first, then lowest id
        resident[int(layer)] = entries[max(0, len(entries) - per_layer):]
    return hits / active if active else 1.0


def test_per_layer_lru_hand_counted_with_its_tie_rule():
    """FAILS if a call's tie (experts of one earlier call) evicts the higher id instead of the
    lowest, or if padding counts as a route."""
    # One layer, 3 slots: {0,1} miss miss; {2,3} miss miss -> 4 residents, evict the oldest call's
    # lowest id 0 -> {1,2,3}; {1} hit; {0} miss. 1 hit of 6.
    trace = Trace.from_dense([[[0, 1]], [[2, 3]], [[1, -1]], [[0, -1]]], num_experts=4)
    assert per_layer_lru_hit_rate(trace, 3) == pytest.approx(1 / 6)
    assert _per_layer_lru_brute(trace, 3) == pytest.approx(1 / 6)


@pytest.mark.parametrize("case", range(12))
def test_per_layer_lru_fast_equals_brute_force(case):
    """FAILS if the vectorised simulator drifts from the call-by-call one (slots per layer, ties,
    duplicates, padding, slots >= experts), on dense traces and on many sequences whose last
    tokens miss layers (every call counted, in call order)."""
    rng = random.Random(case)
    layers, experts = rng.randint(1, 4), rng.randint(2, 9)
    top_k = rng.randint(1, min(experts, 3))
    slots = rng.randint(top_k, experts + 1)
    tokens = rng.randint(1, 40)
    routes = np.array([[[rng.randint(-1, experts - 1) for _ in range(top_k)]
                        for _ in range(layers)] for _ in range(tokens)])
    size = slots * layers + rng.randint(0, layers - 1)   # S / L rounds down
    trace = Trace.from_dense(routes, num_experts=experts)
    assert per_layer_lru_hit_rate(trace, size) == _per_layer_lru_brute(trace, size)
    ragged = _ragged_trace(np.random.default_rng(case), sequences=3, layers=layers,
                           experts=experts, top_k=top_k)
    assert per_layer_lru_hit_rate(ragged, size) == _per_layer_lru_brute(ragged, size)


def test_per_layer_lru_with_top_k_slots_is_the_previous_token_repeat():
    """FAILS if per-layer LRU shared slots across layers (2 slots per layer of top-2 hit exactly
    the previous token's experts)."""
    trace = synthetic_trace("mixtral-realistic", num_tokens=1200, seed=0)
    tokens = trace.num_tokens
    lag1 = lag_repeat_probability(trace, 1)[0]
    assert per_layer_lru_hit_rate(trace, 2 * trace.num_layers) == \
        pytest.approx(lag1 * (tokens - 1) / tokens)
    with pytest.raises(ValueError, match="gives 1 slots per layer for 32 layers"):
        per_layer_lru_hit_rate(trace, 32)
