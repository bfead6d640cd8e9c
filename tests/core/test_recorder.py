"""Routes recorded inside a jitted decode loop replay to the counts the loop's own cache made."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_cache as pc
from pallas_cache.sizing import (ReplayConfig, TraceError, init_recorder, load_trace, parse_policy,
                                 record_routes, replay, trace_from_routes)
from pallas_cache.sizing.traces import save_trace

L, E, S, K, B, T, H = 4, 8, 12, 2, 2, 24, 16  # layers, experts, slots, top-k, rows, tokens, width


@jax.jit
def toy_decode(state, recorder, policy, embed, router, tokens):
    """A toy MoE decode loop: a scan over tokens, inside it a scan over layers with a traced
    layer index; each layer routes its rows (top-k of a router matmul, padding rows -1), steps
    the cache with ensure_hybrid and records the routes both ways (recorder and scan output)."""

    def token_step(carry, xs):
        state, recorder = carry
        position, row_tokens = xs
        active = row_tokens >= 0
        h = embed[jnp.maximum(row_tokens, 0)]

        def layer_step(carry, layer):
            state, recorder, h = carry
            _, ids = lax.top_k(h @ router[layer], K)
            ids = jnp.where(active[:, None], ids, -1).astype(jnp.int32)  # [B, K]
            state, _ = pc.ensure_hybrid(state, layer, ids, policy)
            recorder = record_routes(recorder, position, layer, ids)
            return (state, recorder, jnp.tanh(h + router[layer][:, 0])), ids

        (state, recorder, _), ids = lax.scan(layer_step, (state, recorder, h),
                                             jnp.arange(L, dtype=jnp.int32))
        return (state, recorder), ids

    (state, recorder), stacked = lax.scan(token_step, (state, recorder),
                                          (jnp.arange(tokens.shape[0], dtype=jnp.int32), tokens))
    return state, recorder, stacked  # stacked: int32 [T, L, B, K]


def _model(seed=0):
    rng = np.random.default_rng(seed)
    embed = jnp.asarray(rng.standard_normal((32, H), np.float32))
    router = jnp.asarray(rng.standard_normal((L, H, E), np.float32))
    tokens = rng.integers(0, 32, (T, B)).astype(np.int32)
    tokens[rng.random((T, B)) < 0.2] = -1  # padding rows
    return embed, router, jnp.asarray(tokens)


@pytest.mark.parametrize("policy", ["full", "fraction:0.4", "cap:1"])
def test_a_recorded_decode_loop_replays_to_the_loops_own_counts(policy, tmp_path):
    """FAILS if the recorded trace is not the loop's calls in the loop's order (e.g. layer-major,
    a [B, K] call split into B calls, an unwritten buffer row kept as a call, padding lost), as
    the replay's active / missing / fetched counts then differ from the loop's own cache."""
    embed, router, tokens = _model()
    state, recorder, stacked = toy_decode(pc.init(L, E, S), init_recorder(T + 5, L, B * K),
                                          parse_policy(policy), embed, router, tokens)
    from_recorder = trace_from_routes(recorder, num_experts=E)
    from_scan = trace_from_routes(stacked, num_experts=E)
    assert from_recorder == from_scan
    assert (from_scan.num_calls, from_scan.top_k, from_scan.num_tokens) == (T * L, B * K, T)
    save_trace(from_scan, tmp_path / "routes.jsonl")  # what the CLI reads back
    for trace in (from_scan, load_trace(tmp_path / "routes.jsonl")):
        (result,) = replay(trace, [ReplayConfig(S, policy)], bounds=False,
                           progress=lambda line: None)
        loop = pc.stats(state)
        assert (result.calls, result.active, result.missing, result.fetched) == (
            loop.calls, loop.active, loop.missing, loop.fetched)
        assert result.active > result.missing > 0  # a sweep that exercised the cache


def test_records_outside_the_buffer_are_dropped_and_refused():
    """FAILS if a token past the buffer (or a negative one, which a plain index wraps to the last
    row) overwrites a recorded call instead of counting as dropped, or a recorder that dropped
    records silently becomes a shorter trace."""
    recorder = init_recorder(2, 2, 3)
    recorder = record_routes(recorder, 1, 1, jnp.array([4, 5], jnp.int32))
    kept = np.asarray(recorder.routes)
    for token, layer in ((2, 0), (-1, 1), (0, 2), (1, -1)):
        recorder = jax.jit(record_routes)(recorder, token, layer, jnp.array([7], jnp.int16))
    assert int(recorder.dropped) == 4
    np.testing.assert_array_equal(np.asarray(recorder.routes), kept)
    assert np.asarray(recorder.written).sum() == 1
    with pytest.raises(TraceError, match=r"4 record\(s\) fell outside the recorder's 2 tokens x 2"):
        trace_from_routes(recorder, num_experts=8)


def test_recorder_misuse_and_several_sequences():
    """FAILS if too many routes or float routes are accepted at trace time, or sequences of a
    dict lose their names, their order or the padding of a narrower one."""
    recorder = init_recorder(4, 2, 2)
    with pytest.raises(ValueError, match=r"shape \(2, 2\) hold 4 experts .* top_k=2 \(shape "
                                         r"\(4, 2, 2\)\)"):
        record_routes(recorder, 0, 0, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(TypeError, match="integer expert ids, got dtype float32"):
        record_routes(recorder, 0, 0, jnp.zeros(2, jnp.float32))
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        init_recorder(4, 2, 0)
    wide = np.array([[[0, 1], [2, 3]]], np.int32)   # 1 token, 2 layers, top-2
    narrow = np.array([[[4], [5]], [[6], [-1]]])    # 2 tokens, 2 layers, top-1
    trace = trace_from_routes({"a": wide, "b": narrow}, num_experts=8)
    assert trace.sequence_names == ("a", "b")
    assert trace.routes.tolist() == [[0, 1], [2, 3], [4, -1], [5, -1], [6, -1], [-1, -1]]
    assert trace.token_idx.tolist() == [0, 0, 0, 0, 1, 1]
    assert trace.sequence.tolist() == [0, 0, 1, 1, 1, 1]
    with pytest.raises(TraceError, match=r"different layer counts \[2, 3\]"):
        trace_from_routes([wide, np.zeros((1, 3, 2), np.int32)], num_experts=8)
    with pytest.raises(TraceError, match=r"expected integer routes \[tokens, layers, \.\.\.\]"):
        trace_from_routes(np.zeros((2, 2, 2), np.float32), num_experts=8)


def test_the_readme_recorder_snippet_runs_and_replays_to_its_counts(tmp_path, monkeypatch):
    """FAILS if docs/replay.md's recorder snippet no longer runs, or its claim (the trace it
    writes replays to the counts of the loop's own cache) is false."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "replay.md").read_text()
    blocks = [b for b in re.findall(r"^```python[ \t]*\n(.*?)^```", text, re.M | re.S)
              if "init_recorder(" in b]
    assert len(blocks) == 1, "docs/replay.md has one python block using init_recorder"
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme_recorder"}
    exec(compile(blocks[0], "docs/replay.md:recorder", "exec"), scope)
    (result,) = replay(load_trace(tmp_path / "routes.jsonl"),
                       [ReplayConfig(scope["S"], "fraction:0.4")], bounds=False,
                       progress=lambda line: None)
    loop = pc.stats(scope["state"])
    assert (result.calls, result.active, result.missing, result.fetched) == (
        loop.calls, loop.active, loop.missing, loop.fetched)
