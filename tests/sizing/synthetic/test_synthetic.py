"""The synthetic generators deliver what their knobs promise, seeded and exactly reproducible.

The tests measure what each family promises, so a naive generator fails: fresh draws that may
repeat the previous token's experts, duplicate experts within a call, an unseeded RNG, a skew
that ignores the layer, vectorised Gumbel draws that change a route, or (token-structured
family) routes without token identity or context, or copies that do not repeat.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pallas_cache.sizing.synthetic import (DEFAULT_PRESET_TOKENS, PRESETS, RealisticParams,
                                           SyntheticParams, layer_exponents, realistic_token_ids,
                                           synthetic_trace, zipf_reuse)
from pallas_cache.sizing.trace_stats import (lag_repeat_probability, neighbour_precision,
                                             trace_statistics)


TOKENS = 2000


@pytest.fixture(scope="module")
def mixtral():
    return synthetic_trace("mixtral-like", num_tokens=TOKENS, seed=0)


@pytest.fixture(scope="module")
def fine_grained():
    return synthetic_trace("fine-grained", num_tokens=600, seed=0)


REALISTIC = ("mixtral-realistic", "fine-grained-realistic")


@pytest.fixture(scope="module")
def mixtral_realistic():
    return synthetic_trace("mixtral-realistic", num_tokens=1200, seed=0)


# ---- the Zipf-popularity and reuse family ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_their_geometry_and_a_laptop_sized_default(name):
    params = PRESETS[name]
    trace = synthetic_trace(name, num_tokens=40, seed=3)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == \
        (params.num_layers, params.num_experts, params.top_k)
    assert trace.num_calls == 40 * params.num_layers and trace.is_dense()
    assert trace.layers.tolist()[: params.num_layers] == list(range(params.num_layers))
    # top-k routing: distinct experts per call, no padding, all in range.
    routes = trace.routes
    assert routes.min() >= 0 and routes.max() < params.num_experts
    assert (np.diff(np.sort(routes, axis=1), axis=1) > 0).all()
    assert params.num_tokens == DEFAULT_PRESET_TOKENS == 512
    assert synthetic_trace(name).num_calls == 512 * params.num_layers


def test_same_seed_same_trace_different_seed_different_trace():
    a = synthetic_trace("mixtral-like", num_tokens=200, seed=11)
    b = synthetic_trace("mixtral-like", num_tokens=200, seed=11)
    c = synthetic_trace("mixtral-like", num_tokens=200, seed=12)
    assert a == b
    assert not np.array_equal(a.routes, c.routes)
    assert not np.array_equal(layer_exponents(PRESETS["mixtral-like"], 11),
                              layer_exponents(PRESETS["mixtral-like"], 12))
    # More tokens from the same seed extend the trace rather than redraw it.
    longer = synthetic_trace("mixtral-like", num_tokens=300, seed=11)
    assert np.array_equal(longer.routes[: a.num_calls], a.routes)


def test_mixtral_like_is_near_flat_with_mixtral_reuse(mixtral):
    stats = trace_statistics(mixtral)
    assert 0.95 <= stats.mean_norm_entropy <= 0.99
    assert 0.33 <= stats.mean_reuse_rate <= 0.42
    assert stats.working_set_max == 8


def test_fine_grained_is_clearly_skewed(mixtral, fine_grained):
    stats = trace_statistics(fine_grained)
    assert stats.mean_norm_entropy < trace_statistics(mixtral).mean_norm_entropy - 0.05
    assert stats.mean_norm_entropy < 0.9
    # Skew concentrates mass: a uniform router would give the hottest 1/8 of experts 1/8 of it.
    histogram = np.sort(fine_grained.routing_histogram(), axis=1)[:, ::-1]
    head_share = histogram[:, :16].sum(axis=1) / histogram.sum(axis=1)
    assert head_share.mean() > 0.4
    assert abs(stats.mean_reuse_rate - PRESETS["fine-grained"].reuse) < 0.03


@pytest.mark.parametrize("reuse", [0.0, 0.5, 0.8, 1.0])
def test_reuse_knob_is_the_measured_previous_token_reuse(reuse):
    params = SyntheticParams(num_layers=4, num_experts=16, top_k=4, num_tokens=1500, skew=0.5,
                             reuse=reuse)
    measured = trace_statistics(synthetic_trace(params, seed=1)).mean_reuse_rate
    # With independent fresh draws, reuse=0 would measure about K/E = 0.25: the exact knob is
    # what makes 0 mean "never reused".
    assert measured == pytest.approx(reuse, abs=0.03)


def test_reuse_when_fresh_experts_run_short_falls_back_to_dropped_ones():
    # E = 3 < 2K = 4: a call keeping nothing must still route 2 distinct experts, so at least
    # one of the previous two comes back.
    params = SyntheticParams(num_layers=2, num_experts=3, top_k=2, num_tokens=300, reuse=0.0)
    trace = synthetic_trace(params, seed=0)
    assert (np.diff(np.sort(trace.routes, axis=1), axis=1) > 0).all()
    assert trace_statistics(trace).mean_reuse_rate == pytest.approx(0.5, abs=1e-12)
    full = synthetic_trace(SyntheticParams(num_layers=1, num_experts=3, top_k=3, num_tokens=5))
    assert (full.routes == [0, 1, 2]).all()


def test_skew_knob_orders_entropy_and_spread_varies_it_across_layers():
    base = SyntheticParams(num_layers=12, num_experts=32, top_k=2, num_tokens=1500, reuse=0.2)
    entropies = [trace_statistics(synthetic_trace(dataclasses.replace(base, skew=s))
                                  ).mean_norm_entropy for s in (0.0, 0.8, 1.6)]
    assert entropies[0] > 0.98 and entropies[0] > entropies[1] + 0.05 > entropies[2] + 0.1

    same = trace_statistics(synthetic_trace(dataclasses.replace(base, skew=1.0)))
    spread = trace_statistics(synthetic_trace(dataclasses.replace(base, skew=1.0,
                                                                  skew_spread=0.9)))
    assert np.ptp(spread.norm_entropy) > 2 * np.ptp(same.norm_entropy)
    assert np.ptp(layer_exponents(dataclasses.replace(base, skew=1.0))) == 0.0


def test_per_layer_skew_is_applied_to_its_layer():
    params = SyntheticParams(num_layers=3, num_experts=16, top_k=1, num_tokens=2000,
                             skew=(0.0, 3.0, 0.0))
    entropy = trace_statistics(synthetic_trace(params, seed=2)).norm_entropy
    assert entropy[0] > 0.97 and entropy[2] > 0.97 and entropy[1] < 0.5
    assert layer_exponents(params).tolist() == [0.0, 3.0, 0.0]


@pytest.mark.parametrize("changes,message", [
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(reuse=1.5), r"reuse must be a probability in \[0, 1\], got 1.5"),
    (dict(reuse=math.nan), "reuse must be a probability"),
    (dict(skew=-1.0), "skew must be a finite Zipf exponent"),
    (dict(skew=(1.0, 2.0)), "skew has 2 per-layer values but num_layers=32"),
    (dict(skew_spread=-0.1), "skew_spread must be a finite number >= 0"),
])
def test_bad_knobs_are_refused_with_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["mixtral-like"], **changes)


def test_bad_preset_and_seed_are_refused():
    with pytest.raises(KeyError, match="unknown synthetic preset 'mixtral'"):
        synthetic_trace("mixtral")
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        synthetic_trace("mixtral-like", seed=-1)


# ---- the vectorised Gumbel draws decide exactly what rng.gumbel decides ---------------------


def _routes_drawn_by_gumbel(params, seed):
    """The generator as first written: ``rng.gumbel`` draws and a full argsort per token. The
    vectorised draws must reproduce it route for route."""
    rng = np.random.default_rng(seed)
    _, log_popularity = zipf_reuse.layer_popularity(params, rng)
    layers, experts, top_k = params.num_layers, params.num_experts, params.top_k
    rows, columns = np.arange(layers)[:, None], np.arange(top_k)[None, :]
    penalty = 1e9 + 4.0 * float(np.abs(log_popularity).max())
    keys = log_popularity + rng.gumbel(size=(layers, experts))
    previous = np.sort(np.argsort(-keys, axis=1)[:, :top_k], axis=1)
    out = [previous]
    for _ in range(1, params.num_tokens):
        keys = log_popularity + rng.gumbel(size=(layers, experts))
        keep = rng.random((layers, top_k)) < params.reuse
        keys[rows, previous] = np.where(keep, -np.inf, keys[rows, previous] - penalty)
        fresh = np.argsort(-keys, axis=1)[:, :top_k]
        take = columns < top_k - keep.sum(axis=1, keepdims=True)
        chosen = np.concatenate([previous, fresh], axis=1)[np.concatenate([keep, take], axis=1)]
        previous = np.sort(chosen.reshape(layers, top_k), axis=1)
        out.append(previous)
    return np.stack(out).reshape(-1, top_k)


@pytest.mark.parametrize("margin", ["default", "every token exact"])
@pytest.mark.parametrize("params,seed", [
    (dataclasses.replace(PRESETS["fine-grained"], num_tokens=300), 0),
    (dataclasses.replace(PRESETS["fine-grained"], num_tokens=300), 5),
    (SyntheticParams(num_layers=8, num_experts=128, top_k=8, num_tokens=300, reuse=0.9), 2),
    (SyntheticParams(num_layers=64, num_experts=16, top_k=4, num_tokens=300, skew=0.0), 3),
])
def test_vectorised_draws_give_the_routes_gumbel_gives(monkeypatch, params, seed, margin):
    """FAILS if the vectorised Gumbel draws change a single route against ``rng.gumbel`` with a
    full argsort: a stream consumed in another order, NumPy's ``log`` deciding a near-tie, or a
    partial sort ranking the top experts otherwise. With a huge margin every token takes the
    exact path, which must agree too."""
    if margin != "default":
        monkeypatch.setattr(zipf_reuse, "GUMBEL_MARGIN", 1e30)
    trace = synthetic_trace(params, seed=seed)
    np.testing.assert_array_equal(trace.routes, _routes_drawn_by_gumbel(params, seed))


def test_exact_draws_are_gumbel_bit_for_bit_and_fast_ones_within_a_few_ulp():
    """FAILS if ``GumbelDraws.exact`` is not ``rng.gumbel``'s value bit for bit (NumPy's ``log``
    differs in the last bits for some draws), or if the generator's stream is left elsewhere."""
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    noise = zipf_reuse.GumbelDraws(a, (64, 128))
    want = b.gumbel(size=(64, 128))
    assert np.array_equal(noise.exact(), want)
    assert np.abs(noise.fast - want).max() < 1e-14
    assert a.random() == b.random()


class _ScriptedUniforms:
    """A stand-in generator whose ``random`` returns scripted doubles (zeros included)."""

    def __init__(self, values):
        self.values = list(values)

    def random(self, size):
        out, self.values = self.values[:size], self.values[size:]
        return np.asarray(out, dtype=np.float64)


def test_a_zero_uniform_is_skipped_as_gumbel_skips_it():
    """FAILS if a ``random() == 0`` draw is used (``gumbel`` rejects it: ``log(-log(1))`` is
    infinite) or if the draws after it are not shifted up by one, as ``gumbel``'s are."""
    script = [0.5, 0.0, 0.25, 0.0, 0.0, 0.75, 0.125, 0.9]
    noise = zipf_reuse.GumbelDraws(_ScriptedUniforms(script), (2, 2))
    used = [0.5, 0.25, 0.75, 0.125]
    want = np.array([-math.log(-math.log(1.0 - u)) for u in used]).reshape(2, 2)
    assert np.array_equal(noise.exact(), want)
    assert np.allclose(noise.fast, want, rtol=0, atol=1e-14)


def test_near_ties_are_left_to_the_exact_draws():
    """FAILS if ``clear_top_ranks`` decides a ranking whose top ``K + 1`` keys are closer than
    the margin (absolute near 0, relative to the key near the dropped-expert penalty's 1e9), or
    one with an ``-inf`` neighbour, or ranks clear keys otherwise than a full argsort."""
    rows = np.arange(2)[:, None]
    keys = np.array([[3.0, 1.0, 2.0, -1.0, 0.5], [0.1, 0.4, 0.3, 0.2, -2.0]])
    np.testing.assert_array_equal(zipf_reuse.clear_top_ranks(keys, 2, rows),
                                  np.argsort(-keys, axis=1)[:, :2])
    tie = keys.copy()
    tie[0, 1] = 1.0 + 1e-14 + 1.0  # 2.0 + 1e-14 against 2.0: ranks 2 and 3 nearly tied
    assert zipf_reuse.clear_top_ranks(tie, 2, rows) is None
    big = keys.copy()
    big[1] = [-1e9, -1e9 - 1e-6, -1e9 - 2e-6, -1e9 - 1.0, -2e9]  # 1e-6 apart: < 1e-12 * 1e9
    assert zipf_reuse.clear_top_ranks(big, 2, rows) is None
    inf = keys.copy()
    inf[0, [0, 2, 1, 3]] = -np.inf  # the top three include -inf neighbours
    assert zipf_reuse.clear_top_ranks(inf, 2, rows) is None


# ---- the token-structured family ------------------------------------------------------------


@pytest.mark.parametrize("name", REALISTIC)
def test_realistic_presets_are_valid_dense_top_k_traces(name):
    """FAILS if a call routes repeated or out-of-range experts or the geometry is not the
    preset's."""
    params = PRESETS[name]
    trace = synthetic_trace(name, num_tokens=30, seed=5)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == \
        (params.num_layers, params.num_experts, params.top_k)
    assert trace.is_dense() and trace.num_calls == 30 * params.num_layers
    assert trace.routes.dtype == np.int32 and trace.routes.min() >= 0
    assert trace.routes.max() < params.num_experts
    assert (np.diff(trace.routes, axis=1) > 0).all()   # sorted, distinct
    assert f"synthetic:{name}(tokens=30, seed=5)" == trace.source
    ids = realistic_token_ids(dataclasses.replace(params, num_tokens=30), seed=5)
    assert ids.dtype == np.int32 and ids.shape == (30,)
    assert ids.min() >= 0 and ids.max() < params.vocab_size


def test_realistic_is_seeded_and_a_longer_trace_extends_a_shorter_one():
    """FAILS if the generator is unseeded, or draws a quantity from a stream whose position
    depends on the token count (then the first tokens change with num_tokens)."""
    a = synthetic_trace("mixtral-realistic", num_tokens=1100, seed=3)
    assert a == synthetic_trace("mixtral-realistic", num_tokens=1100, seed=3)
    assert not np.array_equal(a.routes, synthetic_trace("mixtral-realistic", num_tokens=1100,
                                                        seed=4).routes)
    longer = synthetic_trace("mixtral-realistic", num_tokens=1500, seed=3)  # past one block
    assert np.array_equal(longer.routes[: a.num_calls], a.routes)


def test_repeats_fade_with_lag_and_stay_above_chance(mixtral_realistic):
    """FAILS if routes carry no context from recent tokens (lag 1 would be no higher than the
    longer lags), or the repeat profile dips below chance (the measured Mixtral-8x7B profile
    falls monotonically to about 0.27, above chance 0.25)."""
    lags = lag_repeat_probability(mixtral_realistic, 8)
    chance = 2 / 8
    assert lags[0] > lags[1] > lags[2]
    assert lags[0] > lags[3:].max() + 0.03
    assert lags.min() > chance


def test_past_tokens_predict_the_next_layers_only_with_token_identity(mixtral_realistic):
    """FAILS if the realistic routes lost their token identity across layers (then a matching
    past token predicts no better than the token-free preset)."""
    realistic = neighbour_precision(mixtral_realistic, 64)
    token_free = neighbour_precision(synthetic_trace("mixtral-like", num_tokens=600), 64)
    assert token_free < 0.35 and realistic > 0.5


def test_copied_spans_repeat_earlier_token_sequences():
    """FAILS if copy_prob is ignored: copied spans make bigrams recur far more than Zipf draws."""
    base = RealisticParams(num_layers=1, num_experts=4, top_k=1, num_tokens=3000,
                           vocab_size=5000, vocab_zipf=0.5, copy_prob=0.0)

    def recurring_bigrams(params):
        ids = realistic_token_ids(params, seed=0)
        seen, again = set(), 0
        for pair in zip(ids[:-1].tolist(), ids[1:].tolist()):
            again += pair in seen
            seen.add(pair)
        return again / (len(ids) - 1)

    assert recurring_bigrams(base) < 0.02
    assert recurring_bigrams(dataclasses.replace(base, copy_prob=0.1, copy_span=8.0)) > 0.4


@pytest.mark.parametrize("changes,message", [
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(copy_prob=1.5), r"copy_prob must be a probability in \[0, 1\], got 1.5"),
    (dict(copy_span=0.5), "copy_span must be a finite number >= 1, got 0.5"),
    (dict(context=()), "context must be a non-empty sequence of finite taps"),
    (dict(context=3.0), "context must be a sequence of filter taps, got 3.0"),
    (dict(layer_noise=-1.0), "layer_noise must be a finite number >= 0"),
])
def test_bad_realistic_knobs_are_refused_with_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["mixtral-realistic"], **changes)
